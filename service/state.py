"""What every endpoint shares: the model, its engine loop, the workers, limits, metrics.

Also the things every generation endpoint does the same way: encoding its media within the
engine's budget, building its prompt off the event loop, running it against its deadline,
and noticing a client that left before a non-streamed answer was ready. A request's deadline
is its `X-Request-Timeout` header (seconds), capped by the server's `request_timeout_s`,
counted from its arrival.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
from starlette.requests import HTTPConnection, Request

from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.processor import Prompt
from stillcut.engine.request import SamplingParams
from stillcut.service.api import VideoLLM
from stillcut.service.async_engine import AsyncEngine
from stillcut.service.config import ServerConfig
from stillcut.service.errors import APIError, ClientGone, bad_request
from stillcut.service.media_budget import MediaBudget
from stillcut.service.metrics import ServiceMetrics
from stillcut.service.record import RequestRecord
from stillcut.service.worker import Worker
from stillcut.vision.pipeline import ImageInput, VideoInput

T = TypeVar("T")
TIMEOUT_HEADER = "x-request-timeout"


@dataclass
class ServiceState:
    """The server's shared objects, created at startup and closed at shutdown."""

    llm: VideoLLM
    engine: AsyncEngine
    encoder: Worker  # the vision pipeline: decode, encode, EVS, thumbnails, live tubelets
    prompter: Worker  # tokenizing prompts; encoder-cache hits
    config: ServerConfig
    metrics: ServiceMetrics
    http: httpx.AsyncClient
    live_sessions: int = 0  # open WebSocket sessions (touched on the event loop only)
    started: float = field(default_factory=time.time)

    @property
    def num_jobs_pending(self) -> int:
        """Requests waiting for (or in) the encode or the prompt worker."""
        return self.encoder.num_pending + self.prompter.num_pending

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is None or the served model's id."""
        if model is not None and model != self.llm.name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.llm.name!r}",
                type="not_found_error",
                code="model_not_found",
            )

    async def encode(
        self,
        inputs: list[VideoInput | ImageInput],
        max_tokens: int,
        record: RequestRecord,
        max_video_tokens: int | None = None,
    ) -> list[MultiModalItem]:
        """Encode a request's media, refused from their headers when they cannot fit the
        engine beside an answer of `max_tokens`. Media all in the encoder cache are looked up
        on the prompt worker, so they do not wait behind other requests' encoding; the rest
        go to the encode worker. `max_video_tokens` is the request's own budget."""
        budget = MediaBudget.of(self.llm.engine.config.scheduler, max_tokens, max_video_tokens)
        lookup = functools.partial(_timed, self.llm.encode_cached, inputs, budget)
        items, run_s = await self.prompter.run(lookup)
        if items is None:
            encode = functools.partial(_timed, self.llm.encode, inputs, budget)
            items, run_s = await self.encoder.run(encode)
        record.add_media(items, run_s)
        return items

    async def build_prompt(self, build: Callable[[], Prompt]) -> Prompt:
        """`build()` (tokenizing a prompt) on the prompt worker, off the event loop."""
        return await self.prompter.run(build)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        items: list[MultiModalItem],
        record: RequestRecord,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request; the final one is added to `record`."""
        async for output in self.engine.generate(prompt, params):
            if output.finished:
                record.add_output(items, output)
            yield output


def _timed(
    encode: Callable[..., list[MultiModalItem] | None],
    inputs: list[VideoInput | ImageInput],
    budget: MediaBudget,
) -> tuple[list[MultiModalItem] | None, float]:
    """`encode(inputs, budget=budget)` and the seconds it took."""
    started = time.perf_counter()
    items = encode(inputs, budget=budget)
    return items, time.perf_counter() - started


async def last_output(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Consume a request's outputs; the final one."""
    final = first
    async for output in rest:
        final = output
    return final


def record_of(connection: HTTPConnection) -> RequestRecord:
    return connection.scope["state"]["record"]


def seconds_left(connection: HTTPConnection, config: ServerConfig) -> float:
    """Seconds until the request's deadline (never more than the server's cap)."""
    timeout = config.request_timeout_s
    raw = connection.headers.get(TIMEOUT_HEADER)
    if raw is not None:
        try:
            asked = float(raw)
        except ValueError:
            asked = math.nan
        if not (math.isfinite(asked) and asked > 0):
            raise bad_request(
                f"{TIMEOUT_HEADER} must be a number of seconds > 0, got {raw!r}", "invalid_header"
            )
        timeout = min(timeout, asked)
    return record_of(connection).arrival + timeout - time.monotonic()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising `ClientGone`) if the client hangs up first.
    Call it once the body has been read: the next message can only be a disconnect."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()
