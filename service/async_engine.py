"""AsyncEngine: one `LLMEngine` stepped by one background thread, driven from asyncio.

The engine is not thread-safe, so every call into it (add, abort, step, held-prefix changes,
reading its counters) runs on the engine thread, which takes commands from a queue and steps
while requests are unfinished. Each request's outputs travel back to its event loop through
`call_soon_threadsafe` into an asyncio queue. Admission is bounded: once `max_queue` requests
wait to be scheduled, `generate` raises `QueueFull` (the service's 503). A consumer that stops
iterating, such as a request whose client left, aborts its request and frees its KV blocks.
`shutdown` lets in-flight work finish (or aborts it at the deadline) and joins the thread.
A step that fails (`StepFailed`) fails only the requests it ran, whose readers get it; the loop
goes on. Any other exception from the engine is a fault in its own state: the loop ends and
every reader hears `EngineStopped`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from stillcut.engine.llm_engine import LLMEngine, RequestOutput, StepFailed
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.processor import Prompt
from stillcut.engine.request import SamplingParams

T = TypeVar("T")
_DRAIN_POLL_S = 0.05  # how often an idle engine re-checks a shutdown deadline
logger = logging.getLogger("stillcut.service")


class QueueFull(RuntimeError):
    """The admission queue is full; the client may retry later."""


class EngineStopped(RuntimeError):
    """The engine loop is shut down (or died on an internal error); nothing more is served."""


class RequestAborted(RuntimeError):
    """The request was aborted (by `abort`) while someone was still reading its outputs."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters, published by the engine thread after each step."""

    num_waiting: int = 0
    num_running: int = 0
    num_held: int = 0
    num_blocks: int = 0
    num_blocks_used: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_step: tuple[int, ...] = ()  # verify steps with j drafts accepted, by j
    # recurrent-state snapshots of a hybrid model's prefix cache (0 for other models)
    state_snapshots_saved: int = 0
    state_snapshots_restored: int = 0
    state_snapshots_evicted: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache since the engine started."""
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


@dataclass(frozen=True)
class _Command:
    """Work for the engine thread, and how to tell its waiter when it can never run."""

    run: Callable[[], None]
    fail: Callable[[BaseException], None] = lambda error: None


class _Stream:
    """One request's outputs, handed from the engine thread to the consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_soon(self.loop, self.queue.put_nowait, item)

    async def get(self) -> RequestOutput:
        item = await self.queue.get()
        if isinstance(item, RequestAborted | StepFailed):
            raise item
        if isinstance(item, BaseException):
            raise EngineStopped("the engine stopped on an internal error") from item
        return item


class AsyncEngine:
    """One LLMEngine stepped by one background thread; every engine call runs on that thread."""

    def __init__(self, engine: LLMEngine, *, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        self.engine = engine
        self.max_queue = max_queue
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._lock = threading.Lock()  # guards _in_transit and _closed
        self._in_transit = 0  # adds posted but not yet run by the engine thread
        self._closed = False  # no command is taken any more
        self._accepting = True
        self._error: BaseException | None = None
        self._drain_deadline: float | None = None  # set by shutdown: finish work until then
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="stillcut-engine", daemon=True)
        self._thread.start()

    # ---- the event loop side -----------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Requests accepted but not yet scheduled."""
        return self.stats.num_waiting + self._in_transit

    @property
    def is_running(self) -> bool:
        """False once shutting down, or after the engine thread died."""
        return self._accepting and self._error is None and self._thread.is_alive()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        hold: bool = False,
        streaming: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; the last has `finished`.

        Admission errors (`QueueFull`, `RequestTooLong`, ...) raise on the first iteration.
        Leaving the iteration early, or cancelling it, aborts the request. A `hold=True`
        request yields one output with finish_reason "held" once its prefill is done. A
        `streaming=True` request yields its segments' outputs (each segment's last has
        `segment_end`) for as long as it gets input (`append_input`).
        """
        self._reserve_slot()
        request_id = request_id or f"{self._id_prefix}-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        finished = False

        def add() -> None:
            try:
                self.engine.add_request(
                    prompt,
                    params,
                    request_id=request_id,
                    cache_salt=cache_salt,
                    hold=hold,
                    streaming=streaming,
                )
                self._streams[request_id] = stream
            finally:
                self._release_slot()
                self._publish_stats()  # the request now counts as waiting in the scheduler

        try:
            await self._submit(add, on_fail=self._release_slot)
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._post(_Command(lambda: self._abort_now(request_id)))

    async def extend_held(
        self,
        request_id: str,
        new_input: Prompt | Sequence[int],
        mm_items: Sequence[MultiModalItem] = (),
    ) -> RequestOutput:
        """Extend a held prefix (`LLMEngine.append_input`'s input) and wait until the new
        tokens are prefilled ("held" output)."""
        stream = _Stream(asyncio.get_running_loop())

        def extend() -> None:
            self.engine.append_input(request_id, new_input, mm_items)
            self._streams[request_id] = stream

        await self._submit(extend)
        return await stream.get()

    async def append_input(
        self, request_id: str, token_ids: Sequence[int], mm_items: Sequence[MultiModalItem] = ()
    ) -> None:
        """Give a streaming request more input; its outputs go on in its `generate` stream."""
        await self._submit(lambda: self.engine.append_input(request_id, token_ids, mm_items))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; its result or exception."""
        return await self._submit(lambda: fn(self.engine))

    async def abort(self, request_id: str) -> None:
        """Abort a request in any state (a no-op for unknown or finished ones)."""
        await self._submit(lambda: self._abort_now(request_id))

    def shutdown(self, *, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` seconds when
        `graceful` (abort them otherwise, or at the deadline); release held prefixes; join."""
        self._accepting = False
        self._drain_deadline = time.monotonic() + (timeout if graceful else 0.0)
        self._post(_Command(lambda: None))  # wake an idle engine thread
        self._thread.join()

    # ---- helpers on the event loop side ------------------------------------------------------

    def _reserve_slot(self) -> None:
        if not self.is_running:
            raise EngineStopped("the engine is shutting down or stopped; no new requests")
        with self._lock:
            if self.stats.num_waiting + self._in_transit >= self.max_queue:
                raise QueueFull(
                    f"the admission queue is full ({self.max_queue} requests waiting); retry later"
                )
            self._in_transit += 1

    def _release_slot(self, _error: BaseException | None = None) -> None:
        with self._lock:
            self._in_transit -= 1

    async def _submit(
        self, fn: Callable[[], T], on_fail: Callable[[BaseException], None] | None = None
    ) -> T:
        """Run `fn()` on the engine thread and await its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return  # the awaiting coroutine was cancelled
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def run() -> None:
            try:
                result = fn()
            except Exception as error:  # handed to the awaiting coroutine
                _call_soon(loop, settle, None, error)
            else:
                _call_soon(loop, settle, result, None)

        def fail(error: BaseException) -> None:
            if on_fail is not None:
                on_fail(error)
            _call_soon(loop, settle, None, error)

        self._post(_Command(run, fail))
        return await future

    def _post(self, command: _Command) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return
        command.fail(EngineStopped("the engine is stopped; no request can be served"))

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._run_commands():
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
        except BaseException as error:  # an engine bug: every waiting consumer must hear it
            logger.critical("the engine loop stopped on a fault in its own state", exc_info=error)
            self._error = error
            for stream in self._streams.values():
                stream.put(error)
            self._streams.clear()
        finally:
            self._close()

    def _run_commands(self) -> bool:
        """Run queued commands, waiting for one while idle; False once the loop must end."""
        block = not self.engine.has_unfinished_requests()
        while True:
            draining = self._drain_deadline is not None
            try:
                command = self._commands.get(
                    block=block, timeout=_DRAIN_POLL_S if draining else None
                )
            except queue.Empty:
                break
            command.run()
            block = False
        return self._drain_deadline is None or self._keep_draining()

    def _keep_draining(self) -> bool:
        """During shutdown: keep stepping until idle or past the deadline; then abort the rest
        (held prefixes included) and end the loop."""
        busy = self.engine.has_unfinished_requests()
        if busy and time.monotonic() < self._drain_deadline:
            return True
        for request_id in list(self.engine.scheduler.requests):
            stream = self._streams.pop(request_id, None)
            self.engine.abort(request_id)
            if stream is not None:
                stream.put(EngineStopped("the server shut down before the request finished"))
        self._publish_stats()
        return False

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailed as failed:  # its requests were aborted; the engine is sound
            logger.error("%s: %s", failed, ", ".join(failed.request_ids), exc_info=failed.__cause__)
            for request_id in failed.request_ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(failed)
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _close(self) -> None:
        """Take no more commands; those already queued fail so their awaiters get an answer."""
        with self._lock:
            self._closed = True
        self._accepting = False
        stopped = EngineStopped("the engine is stopped; no request can be served")
        while True:
            try:
                self._commands.get_nowait().fail(stopped)
            except queue.Empty:
                return

    def _abort_now(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        self.engine.abort(request_id)
        if stream is not None:  # a reader still waits: end its iteration
            stream.put(RequestAborted(f"request {request_id!r} was aborted"))

    def _publish_stats(self) -> None:
        scheduler = self.engine.scheduler
        kv = scheduler.kv_cache
        snapshots = kv.snapshots
        self.stats = EngineStats(
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            num_held=scheduler.num_held,
            num_blocks=kv.num_blocks,
            num_blocks_used=kv.num_blocks - kv.num_free_blocks,
            prefix_query_tokens=kv.num_query_tokens,
            prefix_hit_tokens=kv.num_hit_tokens,
            **_speculation_stats(self.engine.speculator),
            state_snapshots_saved=snapshots.num_saved if snapshots else 0,
            state_snapshots_restored=snapshots.num_restored if snapshots else 0,
            state_snapshots_evicted=snapshots.num_evicted if snapshots else 0,
        )


def _speculation_stats(speculator) -> dict[str, Any]:
    if speculator is None:
        return {}
    return {
        "spec_draft_tokens": speculator.num_draft_tokens,
        "spec_accepted_tokens": speculator.num_accepted_tokens,
        "spec_accepted_per_step": tuple(speculator.accepted_per_step),
    }


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the consumer's loop is closed: nobody is left to hear this
