"""A narrating live session: frames in, running commentary out, one streaming request.

Frames arrive, are checked and become tubelets exactly as in a question-answer `LiveSession`
(threshold EVS whose reference carries from tubelet to tubelet; EVS off is the same pruner
keeping every token), but each tubelet is its own one-tubelet video (t = 0, grid (1, h, w)).
A speaker task appends ready tubelets to one streaming request (its time as the family writes
it, `PromptProcessor.tubelet_time`, then the tubelet, `PromptProcessor.narration_input`) and
streams the segment the model says about it; each `segment` message says how many of its
video tokens EVS kept (`kept_tokens`), how many tokens were prefilled for it
(`prefill_tokens`: those, their wrapper and the last segment's final token) and how long after
its tubelet's last frame arrived its first token came (`lag_s`).
Under lag `queue` every tubelet is appended in order, and at most `max_queued_tubelets` wait:
while that many do, a frame is refused (`BacklogFull`, the session goes on), so a client that
sends faster than the model speaks is told so instead of queueing without bound. Under
`latest` only the newest tubelet waits (a newer one replaces it) and the speaker reports how
many it skipped. A tubelet EVS emptied is not appended. When the next append would pass
`max_context_tokens` or the engine's `max_visual_tokens_per_request`, the request is replaced
by a fresh one holding the instruction and the last `keep_last_s` seconds of tubelets, cut to
half the context and half the visual tokens so that a rollover is followed by room for many
tubelets (a `rollover` message). So a narration goes on however long its
stream, and nothing it holds grows with it.

An engine error ends the narration: it is reported (`error`), its request is freed, `drain`
returns, and `failure` is set for the session to end; later frames are not spoken about.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from stillcut.engine.admission import RequestTooLong, ResourceExhausted, TooManyVisualTokens
from stillcut.engine.llm_engine import StepFailed
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.processor import Prompt
from stillcut.engine.request import PlaceholderRange
from stillcut.service.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestAborted
from stillcut.service.errors import step_failed
from stillcut.service.live_options import LiveError, LiveLimitExceeded
from stillcut.service.live_session import LiveSession, Runner
from stillcut.service.narrate_options import NarrateOptions
from stillcut.vision.pipeline import VisionPipeline

Emit = Callable[[dict[str, Any]], Awaitable[None]]
_ENGINE_ERRORS = (RequestTooLong, TooManyVisualTokens, ResourceExhausted, QueueFull)


class NarrationFailed(RuntimeError):
    """Why a narration stopped: `code` and a message for the client; `caused_by_client` when
    its options or its stream did (a policy close), not the server."""

    def __init__(self, code: str, message: str, caused_by_client: bool) -> None:
        super().__init__(message)
        self.code = code
        self.caused_by_client = caused_by_client


class BacklogFull(LiveError):
    """A frame while `max_queued_tubelets` tubelets wait under lag "queue": it is not taken
    (as if never sent) and the session goes on."""


logger = logging.getLogger("stillcut.service")


class Narration(LiveSession):
    """One client's narrated stream over a shared engine; see the module docstring. Server
    messages go to `emit`: `token`, `segment`, `rollover` and `error`."""

    def __init__(
        self,
        pipeline: VisionPipeline,
        engine: AsyncEngine,
        options: NarrateOptions,
        session_id: str,
        emit: Emit,
        *,
        run_encode: Runner = asyncio.to_thread,
        run_prompt: Runner = asyncio.to_thread,
    ) -> None:
        family = pipeline.model_config.family
        if family.narration_timestamp is None:  # said first: no other option would help
            raise ValueError(f"{family.model_type!r} models do not narrate")
        super().__init__(
            pipeline, engine, options, session_id, run_encode=run_encode, run_prompt=run_prompt
        )
        max_model_len = engine.engine.config.scheduler.max_model_len
        self._max_context = min(options.max_context_tokens or max_model_len, max_model_len)
        self._max_visual = engine.engine.config.scheduler.max_visual_tokens_per_request
        if options.max_tokens_per_segment >= self._max_context:
            raise LiveLimitExceeded(
                f"max_tokens_per_segment={options.max_tokens_per_segment} leaves no room in a "
                f"context of {self._max_context} tokens (max_context_tokens, at most the "
                f"engine's max_model_len={max_model_len}); allowed: fewer than {self._max_context}"
            )
        self._emit = emit
        self._separate_tubelets = True  # each tubelet is its own video: t = 0, grid (1, h, w)
        # ready tubelets, each with when its last frame arrived (monotonic seconds); under
        # lag "latest" only the newest, and the count of those it replaced
        self._ready: collections.deque[tuple[MultiModalItem, float]] = collections.deque()
        self._num_replaced = 0
        self._frame_arrived_at = 0.0
        self._kept: collections.deque[MultiModalItem] = collections.deque()  # the window
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing ready, nothing being said
        self._idle.set()
        self._speaker: asyncio.Task | None = None
        self._stream = None  # the streaming request's outputs
        self._request_id: str | None = None
        self._num_tokens = 0  # in the streaming request's sequence
        self._num_visual = 0  # video tokens in it
        self._num_requests = 0
        self._params = None  # built on first use: finding segment-end tokens takes a second
        self.failure: asyncio.Future[NarrationFailed] = asyncio.get_running_loop().create_future()

    async def add_frame(self, timestamp: float, image: bytes):
        """As a live session's; the time it arrives is when its tubelet's lag starts."""
        self._frame_arrived_at = time.monotonic()
        return await super().add_frame(timestamp, image)

    @property
    def num_ready(self) -> int:
        """Tubelets waiting to be spoken about."""
        return len(self._ready)

    @property
    def backlog_full(self) -> bool:
        """True while a frame would be refused: `max_queued_tubelets` wait under lag "queue"."""
        limit = self.options.limits.max_queued_tubelets
        return self.options.lag == "queue" and len(self._ready) >= limit

    async def drain(self) -> None:
        """Wait until every ready tubelet has been spoken about (or skipped), or the narration
        failed."""
        await self._idle.wait()

    # ---- tubelets ------------------------------------------------------------------------------

    def _check_frame(self, timestamp: float, image: bytes) -> None:
        super()._check_frame(timestamp, image)
        if self.backlog_full:
            limit = self.options.limits.max_queued_tubelets
            raise BacklogFull(
                f"the frame at {timestamp:g} s was not taken: {len(self._ready)} tubelets wait to "
                f"be narrated (max_queued_tubelets={limit}, lag 'queue'); send frames no faster "
                "than they are narrated, or use lag 'latest' to skip to the newest"
            )

    async def _commit(self, item: MultiModalItem) -> None:
        # no list of every tubelet: what outlives speaking is the rollover window (`_kept`)
        self._chain = item.identifier
        if not item.num_tokens or self.failure.done():
            return  # nothing changed enough to show, or nothing more is said
        if self.options.lag == "latest":
            self._num_replaced += len(self._ready)
            self._ready.clear()
        self._ready.append((item, self._frame_arrived_at))
        self._idle.clear()
        self._wake.set()
        if self._speaker is None:
            self._speaker = asyncio.create_task(self._speak())

    async def _release(self) -> None:
        if self._speaker is not None:
            self._speaker.cancel()
            await asyncio.gather(self._speaker, return_exceptions=True)
        await self._end_request()
        self._idle.set()

    # ---- speaking ------------------------------------------------------------------------------

    async def _speak(self) -> None:
        while True:
            while not self._ready:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
            item, arrived_at = self._ready.popleft()
            skipped, self._num_replaced = self._num_replaced, 0
            try:
                await self._append(item)
                text, num_prefilled, lag_s = await self._segment(arrived_at)
            except NarrationFailed as failed:
                await self._stop_speaking(failed)
                return
            except StepFailed:
                message = step_failed(0).message
                await self._stop_speaking(NarrationFailed("step_failed", message, False))
                return
            except (*_ENGINE_ERRORS, EngineStopped, RequestAborted) as error:
                await self._stop_speaking(NarrationFailed("engine", str(error), True))
                return
            except Exception:
                logger.exception("narration %s failed", self.session_id)
                message = "internal server error while narrating"
                await self._stop_speaking(NarrationFailed("internal_error", message, False))
                return
            t_first, t_last = item.timestamps[0], item.timestamps[-1]
            await self._emit(
                {
                    "type": "segment",
                    "t": [t_first, t_last],
                    "text": text,
                    "skipped": skipped,
                    "kept_tokens": item.num_tokens,
                    "prefill_tokens": num_prefilled,
                    "lag_s": lag_s,
                }
            )

    async def _stop_speaking(self, failed: NarrationFailed) -> None:
        """Nothing more is said: the request is freed, `drain` returns, `failure` is set."""
        self._ready.clear()
        self.failure.set_result(failed)
        self._idle.set()
        try:
            await self._emit({"type": "error", "code": failed.code, "message": str(failed)})
        finally:
            await self._end_request()

    async def _append(self, item: MultiModalItem) -> None:
        processor = self._processor
        if self._params is None:
            ends = await self._run_prompt(
                lambda: processor.segment_end_token_ids(self.options.segment_end)
            )
            self._params = self.options.sampling(ends)
        new_ids = processor.narration_input(item, processor.tubelet_time(item))
        self._keep_window(item)
        room = self._max_context - self.options.max_tokens_per_segment
        fits = (
            self._num_tokens + len(new_ids) <= room
            and self._num_visual + item.num_tokens <= self._max_visual
        )
        if self._request_id is None or not fits:
            if self._request_id is not None:
                await self._end_request()
                await self._emit({"type": "rollover"})
            await self._start_request()
            return
        await self._engine.append_input(self._request_id, new_ids, [item])
        self._num_tokens += len(new_ids)
        self._num_visual += item.num_tokens

    def _keep_window(self, item: MultiModalItem) -> None:
        """Remember `item` and forget tubelets that start over `keep_last_s` before it ends
        (it stays: a fresh sequence holds at least the tubelet it is about)."""
        self._kept.append(item)
        oldest = item.timestamps[-1] - self.options.keep_last_s
        while len(self._kept) > 1 and self._kept[0].timestamps[0] < oldest:
            self._kept.popleft()

    async def _start_request(self) -> None:
        """A fresh streaming request: the instruction and the kept tubelets (the oldest
        dropped while they and a segment pass half the context, or they pass half the visual
        tokens a request may hold)."""
        prompt = self._window_prompt()
        while len(self._kept) > 1 and (
            self._tokens_with_segment(prompt) > self._max_context // 2
            or _num_visual(prompt) > self._max_visual // 2
        ):
            self._kept.popleft()
            prompt = self._window_prompt()
        if self._tokens_with_segment(prompt) > self._max_context:
            raise NarrationFailed(
                "context_too_small",
                f"the instruction, one tubelet and a segment take "
                f"{self._tokens_with_segment(prompt)} tokens, more than "
                f"max_context_tokens={self._max_context}; raise max_context_tokens or lower "
                "max_tokens_per_segment, fps or the frame size",
                True,
            )
        self._num_requests += 1
        self._request_id = f"{self.session_id}-narrate-{self._num_requests}"
        self._num_tokens = len(prompt.token_ids)
        self._num_visual = _num_visual(prompt)
        self._stream = self._engine.generate(
            prompt, self._params, request_id=self._request_id, streaming=True
        )

    def _tokens_with_segment(self, prompt: Prompt) -> int:
        return len(prompt.token_ids) + self.options.max_tokens_per_segment

    def _window_prompt(self) -> Prompt:
        processor, items = self._processor, list(self._kept)
        first = processor.narration_prompt(
            self.options.prompt, items[0], processor.tubelet_time(items[0])
        )
        token_ids, positions = list(first.token_ids), list(first.mm_positions)
        pad = processor.special.video_token_id
        for item in items[1:]:
            ids = processor.narration_input(item, processor.tubelet_time(item))
            positions.append(PlaceholderRange(len(token_ids) + ids.index(pad), item.num_tokens))
            token_ids += ids
        return Prompt(token_ids, items, positions)

    async def _segment(self, arrived_at: float) -> tuple[str, int, float]:
        """Stream one segment's tokens; its text, the tokens prefilled before it (the append's,
        with the last segment's final token; a fresh request's whole prompt) and the seconds
        from its tubelet's last frame arriving to its first token."""
        pieces, num_prefilled, lag_s = [], 0, None
        async for output in self._stream:
            self._num_tokens += len(output.new_token_ids)
            if lag_s is None:
                lag_s = time.monotonic() - arrived_at
            metrics = output.metrics
            appended = metrics.append_prefill_tokens
            num_prefilled = appended[-1] if appended else metrics.num_prompt_tokens
            if output.delta:
                pieces.append(output.delta)
                await self._emit({"type": "token", "text": output.delta})
            if output.segment_end is not None:
                break
        return "".join(pieces), num_prefilled, lag_s

    async def _end_request(self) -> None:
        stream, self._stream, self._request_id = self._stream, None, None
        if stream is not None:
            await stream.aclose()  # leaving the stream aborts the request, freeing its blocks


def _num_visual(prompt: Prompt) -> int:
    return sum(item.num_tokens for item in prompt.items)
