"""Which replica serves a request: rendezvous hashing on its affinity key, within a load margin.

Each replica holds a slot, the rank Ray Serve gives it (a replica restarted after a crash
takes its predecessor's rank). A key prefers the slot with the highest hash of (key, slot), so
when a replica leaves only its keys move, and its replacement takes exactly those back. When
the preferred replica has more than `margin` requests in flight beyond the least-loaded one,
the request goes to the least-loaded one instead (ties in the key's own order, so a hot key
spills onto one other replica rather than onto all). Requests without a key (live sessions,
`/v1/models`) are placed by Ray Serve's own power-of-two-choices; a request pinned to a
replica (a live session's frames) goes there.

The router is Ray Serve's pluggable `RequestRouter`, run by the ingress's handle in the
ingress process: "in flight" is Ray's own count of a replica's ongoing requests (its
queue-length cache, probed where stale), plus the requests it has placed there that Ray has
not sent yet, so a burst placed at once sees its own members. It writes the key's preferred
replica on the request's `RouteHint`, which the ingress reads back to log whether the
request got it. (Ray ships this module to the handle by value, so `RouteHint` lives
elsewhere: both sides must share its one class.)
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from stillcut.service.cluster.affinity import RouteHint

DEFAULT_MARGIN = 4
PLACEMENT_TTL_S = 1.0


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


class MediaAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve's request router for the engine replicas; see the module docstring. Unlike
    Ray's default it has no FIFO mixin: the replica chosen for a request serves that request,
    not whichever one waited longest (Ray's own prefix-aware router does the same)."""

    def initialize_state(self, margin: int = DEFAULT_MARGIN) -> None:
        """Called by Ray Serve with the deployment's `request_router_kwargs`."""
        self._margin = margin
        # when each request placed on a replica was placed, until Ray has sent it
        self._placed: defaultdict[ReplicaID, deque[float]] = defaultdict(deque)

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
        if hint.key is None or not candidate_replicas:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request
            )
        loads = await self._loads(candidate_replicas)
        replicas = {r.replica_id.unique_id: r for r in candidate_replicas}
        slots = {replica_id: _slot(r) for replica_id, r in replicas.items()}
        by_id = {replica_id: loads[r.replica_id] for replica_id, r in replicas.items()}
        chosen, hint.preferred = place(hint.key, slots, by_id, self._margin)
        self._placed[replicas[chosen].replica_id].append(time.monotonic())
        return [[replicas[chosen]]]  # if it cannot take the request now, Ray asks again

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Ray sent a request to `replica_id`: from now on its cache counts it."""
        super().on_send_request(replica_id)
        if self._placed[replica_id]:
            self._placed[replica_id].popleft()

    async def _loads(self, replicas: Sequence[RunningReplica]) -> dict:
        """Requests in flight per replica id: Ray's cached counts, the stale ones probed (as
        Ray's own routers do); one that does not answer in time counts as idle, so a busy
        machine's slow probe does not cost a request its affinity."""
        loads, stale = {}, []
        for replica in replicas:
            queue_len = self.replica_queue_len_cache.get(replica.replica_id)
            if queue_len is None:
                stale.append(replica)
            else:
                loads[replica.replica_id] = queue_len
        for replica, queue_len in await self._probe_queue_lens(stale, 0) if stale else ():
            loads[replica.replica_id] = queue_len or 0
        return {replica: load + self._unsent(replica) for replica, load in loads.items()}

    def _unsent(self, replica_id: ReplicaID) -> int:
        """Requests placed on the replica that Ray has not sent yet. A placement whose send
        never came (the request was cancelled, or placed again) lapses after a second."""
        placed, lapsed = self._placed[replica_id], time.monotonic() - PLACEMENT_TTL_S
        while placed and placed[0] < lapsed:
            placed.popleft()
        return len(placed)


def _slot(replica: RunningReplica) -> str:
    """A replica's stable slot: its rank (published by the replica), else its id."""
    rank = replica.replica_metadata.get("rank")
    return f"rank-{rank}" if rank is not None else replica.replica_id.unique_id
