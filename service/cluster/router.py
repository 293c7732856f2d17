"""Which replica serves a request: rendezvous hashing on its affinity key, within a load margin.

Each replica holds a slot, the rank Ray Serve gives it (a replica restarted after a crash
takes its predecessor's rank). A key prefers the slot with the highest hash of (key, slot), so
when a replica leaves only its keys move, and its replacement takes exactly those back. When
the preferred replica has more than `margin` requests in flight beyond the least-loaded one,
the request goes to the least-loaded one instead (ties in the key's own order, so a hot key
spills onto one other replica rather than onto all). Requests without a key (live sessions,
`/v1/models`), and every request when affinity is off, are placed by Ray Serve's own
power-of-two-choices; a request pinned to a replica (a live session's frames) goes there.

The router is Ray Serve's pluggable `RequestRouter`, run by the ingress's handle in the
ingress process: "in flight" is Ray's own count of a replica's ongoing requests (its
queue-length cache, probed where stale). It writes the key's preferred replica on the
request's `RouteHint`, which the ingress reads back to log whether the request got it. (Ray
ships this module to the handle by value, so `RouteHint` lives elsewhere: both sides must
share its one class.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from stillcut.service.cluster.affinity import RouteHint

DEFAULT_MARGIN = 4


def rendezvous_order(key: bytes, slots: Mapping[str, str]) -> list[str]:
    """Replica ids (`slots`: id -> slot) in the key's order of preference, best first."""

    def score(replica: str) -> bytes:
        return hashlib.sha256(key + b"\0" + slots[replica].encode()).digest()

    return sorted(slots, key=score, reverse=True)


def place(
    key: bytes, slots: Mapping[str, str], loads: Mapping[str, int], margin: int
) -> tuple[str, str]:
    """(chosen, preferred) replica ids for `key`: its preferred replica, unless that one has
    more than `margin` requests in flight beyond the least-loaded one."""
    order = rendezvous_order(key, slots)
    preferred = order[0]
    least = min(loads[replica] for replica in order)
    if loads[preferred] - least <= margin:
        return preferred, preferred
    return next(replica for replica in order if loads[replica] == least), preferred


class MediaAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's request router for the engine replicas; see the module docstring."""

    def initialize_state(self, affinity: bool = True, margin: int = DEFAULT_MARGIN) -> None:
        """Called by Ray Serve with the deployment's `request_router_kwargs`."""
        self._affinity = affinity
        self._margin = margin

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hint = pending_request.kwargs.get("route") if pending_request is not None else None

        if not isinstance(hint, RouteHint):
            hint = RouteHint()
        if hint.pin is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == hint.pin]
            if pinned:
                return [pinned]
        loads = await self._loads(candidate_replicas) if hint.key is not None else {}
        if not (self._affinity and loads):
            return await super().choose_replicas(candidate_replicas, pending_request)
        replicas = {r.replica_id.unique_id: r for r in candidate_replicas if r.replica_id in loads}
        slots = {replica_id: _slot(r) for replica_id, r in replicas.items()}
        by_id = {replica_id: loads[r.replica_id] for replica_id, r in replicas.items()}
        chosen, hint.preferred = place(hint.key, slots, by_id, self._margin)

        others = [r for replica_id, r in replicas.items() if replica_id != chosen]
        return [[replicas[chosen]], others] if others else [[replicas[chosen]]]

    async def _loads(self, replicas: Sequence[RunningReplica]) -> dict:
        """Requests in flight per replica id: Ray's cached counts, the stale ones probed (as
        Ray's own routers do); a replica that does not answer is left out."""
        loads, stale = {}, []
        for replica in replicas:
            queue_len = self.replica_queue_len_cache.get(replica.replica_id)
            if queue_len is None:
                stale.append(replica)
            else:
                loads[replica.replica_id] = queue_len
        for replica, queue_len in await self._probe_queue_lens(stale, 0) if stale else ():
            if queue_len is not None:
                loads[replica.replica_id] = queue_len
        return loads


def _slot(replica: RunningReplica) -> str:
    """A replica's stable slot: its rank (published by the replica), else its id."""
    rank = replica.replica_metadata.get("rank")
    return f"rank-{rank}" if rank is not None else replica.replica_id.unique_id
