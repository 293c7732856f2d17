"""One engine replica: a whole stillcut server (model, engine loop, workers, caches) inside a
Ray Serve replica, answering what the ingress forwards.

It runs the very app `stillcut serve` runs, lifespan included, so each request is checked and
answered exactly as on one machine; only the transport differs (`forwarding`). What is per
replica: the model's weights, the encoder cache, the KV pool and prefix cache, the queues,
`max_sessions`. A live session is one streamed `live` call, fed the client's messages by
`live_message` calls the router pins to this replica. Ray restarts a replica whose process
died or whose engine loop stopped (`check_health`); the replica publishes its rank, the slot
the router hashes keys onto, which a restarted replica inherits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import torch
from ray import serve

from stillcut.engine.config import EngineConfig
from stillcut.service.api import VideoLLM
from stillcut.service.app import create_app, service_health
from stillcut.service.cli_options import RANDOM_WEIGHTS_NOTICE
from stillcut.service.cluster.affinity import RouteHint
from stillcut.service.cluster.forwarding import ForwardedRequest, run_forwarded
from stillcut.service.cluster.logs import configure_logging
from stillcut.service.config import ServerConfig
from stillcut.service.evs_default import UNSET, EVSChoice
from stillcut.vision.decode import DecodeConfig

LIVE_INBOX_MESSAGES = 4  # client messages a session may have waiting before the relay waits


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and how it serves; the same for all of them."""

    model: str | None  # a folder (the same path on every node) or hub id; None: the demo
    server: ServerConfig
    engine_config: EngineConfig
    name: str | None = None  # the id the service reports (default: the folder's name)
    decode_config: DecodeConfig = DecodeConfig()
    evs: EVSChoice = UNSET
    num_cpus: float = 1.0  # the replica's torch threads: this, rounded up
    log_level: str = "info"

    def load(self) -> VideoLLM:
        """The replica's model (the demo checkpoint is built on first use on each node)."""
        return VideoLLM(
            self.model,
            engine_config=self.engine_config,
            decode_config=self.decode_config,
            evs=self.evs,
            name=self.name,
        )


class EngineReplica:
    """The Ray Serve deployment class of the engine replicas (see the module docstring).
    Every method takes the router's `route` argument and ignores it."""

    async def __init__(self, spec: ReplicaSpec) -> None:
        configure_logging(spec.log_level)
        torch.set_num_threads(max(1, math.ceil(spec.num_cpus)))
        llm = spec.load()
        if llm.is_random_demo:
            logging.getLogger("stillcut.service").warning(RANDOM_WEIGHTS_NOTICE)
        self.app = create_app(llm, spec.server)
        self._lifespan = AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._sessions: dict[str, asyncio.Queue] = {}

    def record_replica_metadata(self) -> dict:
        """Published to the router once the replica is ready: its rank (its hash slot)."""
        return {"rank": serve.get_replica_context().rank.rank}

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine loop stopped is restarted."""
        if not self.app.state.service.engine.is_running:
            raise RuntimeError(f"the engine loop of replica {self.replica_id} stopped")

    async def forward(
        self, request: ForwardedRequest, route: RouteHint | None = None
    ) -> AsyncIterator:
        """This replica's id, then the app's messages answering `request`."""
        yield self.replica_id
        async for message in run_forwarded(self.app, request, asyncio.Queue()):
            yield message

    async def live(
        self, request: ForwardedRequest, session_id: str, route: RouteHint | None = None
    ) -> AsyncIterator:
        """This replica's id, then the app's messages on the WebSocket `request` opened."""
        inbox: asyncio.Queue = asyncio.Queue(maxsize=LIVE_INBOX_MESSAGES + 1)
        self._sessions[session_id] = inbox
        try:
            yield self.replica_id
            async for message in run_forwarded(self.app, request, inbox):
                yield message
        finally:
            del self._sessions[session_id]

    async def live_message(
        self, session_id: str, message: dict, route: RouteHint | None = None
    ) -> bool:
        """Hand a client's WebSocket message to its session; False if it is not here."""
        inbox = self._sessions.get(session_id)
        if inbox is None:
            return False
        await inbox.put(message)
        return True

    def health(self, route: RouteHint | None = None) -> dict:
        """The replica's own `/health` body, with its id."""
        return {"replica": self.replica_id, **service_health(self.app.state.service)}

    def metrics_text(self, route: RouteHint | None = None) -> tuple[str, str]:
        """(this replica's id, its own `/metrics` text)."""
        return self.replica_id, self.app.state.service.metrics.render().decode()

    def process_id(self, route: RouteHint | None = None) -> tuple[str, int]:
        """(this replica's id, its process id): what an operator signals to stop it."""
        return self.replica_id, os.getpid()

    async def __del__(self) -> None:
        await self._lifespan.aclose()
