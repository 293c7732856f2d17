"""Long-video summaries for the Python API and the service: where their work runs.

`vision.summary.summarize` runs through a host: `LocalHost` is a `VideoLLM` used directly (its
engine stepped for the summary's length by an `AsyncEngine` of its own, the vision work on a
thread beside it, so chunks encode while others are captioned), `ServiceHost` the server's
workers and engine loop. `summary_request` turns a caller's options into the chunk request and
the summary options.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.processor import Prompt
from stillcut.engine.request import SamplingParams
from stillcut.service.async_engine import AsyncEngine
from stillcut.service.evs_default import EVSChoice
from stillcut.service.progress import SummaryBars
from stillcut.vision.pipeline import VideoSource
from stillcut.vision.summary.chunk_stream import ChunkRequest
from stillcut.vision.summary.result import VideoSummary
from stillcut.vision.summary.summarize import SummaryOptions, chunk_limits, summarize
from stillcut.vision.summary.when import check_when_question

T = TypeVar("T")
VIDEO_OPTIONS = ("fps", "start", "end", "pixels", "max_video_tokens")


def summary_request(
    llm, video: VideoSource, evs: EVSChoice, **options
) -> tuple[ChunkRequest, SummaryOptions]:
    """The chunk request and the summary options of `llm.summarize(video, evs=evs,
    **options)`: `VIDEO_OPTIONS` (`pixels` a mapping; `max_video_tokens` bounds each chunk)
    and `SummaryOptions`' fields. With `evs` left `UNSET`, the chunks take the default, and
    one it would prune to about its first tubelet is kept whole (`chunks.chunk_evs`); a
    setting the caller gives applies as given."""
    if isinstance(video, np.ndarray):
        raise ValueError("a summary takes a video file (a path, bytes or a binary file object)")
    video_options = {name: options.pop(name) for name in VIDEO_OPTIONS if name in options}
    summary_options = SummaryOptions(**options)
    engine = llm.engine
    limits = chunk_limits(
        engine.config.scheduler,
        engine.processor,
        engine.model_config.raw,
        summary_options.caption_tokens,
        video_options.pop("max_video_tokens", None),
    )
    pixels = tuple(sorted(dict(video_options.pop("pixels", None) or {}).items()))
    request = ChunkRequest(
        video,
        llm.resolve_evs(evs),
        limits,
        chunk_s=summary_options.chunk_s,
        overlap_s=summary_options.overlap_s,
        pixels=pixels,
        max_chunks=summary_options.max_chunks,
        whole_short=isinstance(evs, str),  # UNSET: the default, not the caller's setting
        **video_options,
    )
    return request, summary_options


def summarize_here(
    llm,
    video: VideoSource,
    evs: EVSChoice,
    questions: Sequence[str],
    progress: bool,
    **options,
) -> VideoSummary:
    """`llm.summarize` on the calling thread (the caller holds the engine to itself);
    `evs` and `options` as `summary_request`'s."""
    request, summary_options = summary_request(llm, video, evs, **options)
    for question in questions:  # refuse a question that does not ask when, before the work
        check_when_question(question)
    bars = SummaryBars(enabled=progress)

    async def run() -> VideoSummary:
        engine = AsyncEngine(llm.engine, max_queue=max(64, summary_options.max_in_flight))
        try:
            host = LocalHost(llm, engine)
            scheduler = llm.engine.config.scheduler
            return await summarize(
                host, llm.pipeline, llm.processor, scheduler, request, summary_options, bars
            )
        finally:
            await asyncio.to_thread(engine.shutdown, graceful=False)

    try:
        summary = _run(run())
    finally:
        bars.close()
    return with_answers(summary, questions)


def with_answers(summary: VideoSummary, questions: Sequence[str]) -> VideoSummary:
    """`summary` with the answers to `questions` (when-questions) from its timeline."""
    return replace(summary, answers=tuple(summary.when(q) for q in questions))


class LocalHost:
    """A `VideoLLM`'s own pipeline (on a thread) and engine (driven by `engine`)."""

    def __init__(self, llm, engine: AsyncEngine) -> None:
        self.llm, self.engine = llm, engine

    async def vision(self, fn: Callable[[], T]) -> T:
        return await asyncio.to_thread(self.llm.run_vision, fn)

    async def text(self, fn: Callable[[], T]) -> T:
        return await asyncio.to_thread(fn)

    def generate(self, prompt: Prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(prompt, params)


class ServiceHost:
    """The server's vision worker, prompt worker and engine loop; finished requests count in
    the request's record."""

    def __init__(self, state, record) -> None:
        self.state, self.record = state, record

    async def vision(self, fn: Callable[[], T]) -> T:
        return await self.state.encoder.run(lambda: self.state.llm.run_vision(fn))

    async def text(self, fn: Callable[[], T]) -> T:
        return await self.state.prompter.run(fn)

    def generate(self, prompt: Prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return self.state.generate(prompt, params, prompt.items, self.record)


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` to its end, from plain code or from inside a running event loop (a
    notebook's), where it gets a thread and a loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
