"""A video longer than one context: caption it chunk by chunk, then aggregate the captions.

`summarize` opens the video's chunks (`chunk_stream`), and while the vision side encodes the
next batch of chunks, the engine captions those already encoded: each chunk is one request
(`prompts.chunk_caption_messages` with the chunk's times and its video item), at most
`max_in_flight` at once, so the engine batches them and the items held stay bounded. The
captions, in order, are the timeline. Then `rounds` packs them into aggregation prompts and
the engine summarises each; a round's summaries are the next round's captions until one
prompt holds them all. Decoding is greedy, so the same video asked about again gives the same
prompts: the encoder cache (chunk embeddings) and the prefix cache (their prompts) answer most
of a second summary, or of a question about when something happens.

The work runs through a `SummaryHost` (`host`): the Python API and the service each give one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.config import SchedulerConfig
from stillcut.engine.processor import Prompt, PromptProcessor
from stillcut.engine.request import SamplingParams
from stillcut.vision.pipeline import VisionPipeline
from stillcut.vision.summary.chunk_stream import ChunkPlan, ChunkRequest, ChunkStream
from stillcut.vision.summary.chunks import (
    DEFAULT_MAX_CHUNK_S,
    FRAME_MARKER_TOKENS,
    ChunkLimits,
    checkpoint_hints,
)
from stillcut.vision.summary.host import Event, SummaryHost, final_output, in_task_group, one_line
from stillcut.vision.summary.prompts import TimedCaption, chunk_caption_messages
from stillcut.vision.summary.result import SummaryTimings, SummaryUsage, VideoSummary
from stillcut.vision.summary.rounds import aggregate

# the longest times a caption prompt writes, for counting its text tokens
_LONGEST_TIMES = (99998.8, 99999.9)
_VIDEO_MARKER_TOKENS = 2  # the vision start and end markers around a video's tokens


@dataclass(frozen=True)
class SummaryOptions:
    """How a video is summarised.

    `chunk_s` seconds per chunk (None: the longest that fits, see `chunks`), neighbours
    sharing `overlap_s`; at most `caption_tokens` per caption and `summary_tokens` per
    summary; `summarize=False` stops at the timeline. `max_in_flight` caption or aggregation
    requests run at once; a video may give at most `max_chunks` chunks. `captions_per_round`
    caps the captions of one aggregation prompt (None: the checkpoint's own cap, else as many
    as fit)."""

    chunk_s: float | None = None
    overlap_s: float = 0.0
    caption_tokens: int = 128
    summary_tokens: int = 256
    summarize: bool = True
    max_in_flight: int = 8
    max_chunks: int = 4096
    captions_per_round: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_s is not None and not 0 < self.chunk_s <= 3600:
            raise ValueError(f"chunk_s={self.chunk_s!r}: allowed (0, 3600] seconds or None")
        if not 0 <= self.overlap_s < (self.chunk_s or 3600):
            raise ValueError(f"overlap_s={self.overlap_s!r}: allowed [0, chunk_s)")
        for name, low, high in (
            ("caption_tokens", 1, 4096),
            ("summary_tokens", 1, 16384),
            ("max_in_flight", 1, 256),
            ("max_chunks", 1, 1_000_000),
        ):
            value = getattr(self, name)
            if not (
                isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
            ):
                raise ValueError(f"{name}={value!r}: allowed integers in [{low}, {high}]")
        if self.captions_per_round is not None and not self.captions_per_round >= 2:
            raise ValueError(f"captions_per_round={self.captions_per_round!r}: >= 2 or None")


def chunk_limits(
    scheduler: SchedulerConfig,
    processor: PromptProcessor,
    raw_config: Mapping[str, Any],
    caption_tokens: int,
    max_video_tokens: int | None,
) -> ChunkLimits:
    """What bounds a chunk of this engine's model: its context less the caption prompt's text
    and markers and the caption, the engine's visual-token limit and the request's
    `max_video_tokens`; and the checkpoint's longest trained chunk (else
    `DEFAULT_MAX_CHUNK_S`)."""
    messages = chunk_caption_messages(*_LONGEST_TIMES)
    text_only = [{**messages[0], "content": [p for p in messages[0]["content"] if "text" in p]}]
    text_tokens = len(processor.build(text_only).token_ids) + _VIDEO_MARKER_TOKENS
    bounds = [
        scheduler.max_model_len - caption_tokens - text_tokens,
        scheduler.max_visual_tokens_per_request,
    ]
    if max_video_tokens is not None:
        bounds.append(max_video_tokens)
    per_frame = 0 if processor.family.has_video_token else FRAME_MARKER_TOKENS
    hint = checkpoint_hints(raw_config).get("chunk_s", DEFAULT_MAX_CHUNK_S)
    return ChunkLimits(max(0, min(bounds)), float(hint), per_frame)


async def summarize(
    host: SummaryHost,
    pipeline: VisionPipeline,
    processor: PromptProcessor,
    scheduler: SchedulerConfig,
    request: ChunkRequest,
    options: SummaryOptions,
    on_event: Callable[[Event], None] = lambda event: None,
) -> VideoSummary:
    """Summarise `request`'s video (see the module docstring). `on_event` hears the plan
    (`{"type": "plan", ...}`), each caption as it is written (`"chunk"`) and each finished
    aggregation prompt (`"aggregate"`)."""
    started = time.monotonic()
    usage = SummaryUsage()
    stream = ChunkStream(pipeline, request)
    try:
        plan = await host.vision(stream.open)
        on_event(_plan_event(plan))
        timeline = await _caption(host, processor, stream, plan, options, usage, on_event)
    finally:
        await asyncio.to_thread(stream.close)
    captioned = time.monotonic()
    summary, rounds = "", 0
    if options.summarize:
        per_round = options.captions_per_round or checkpoint_hints(pipeline.model_config.raw).get(
            "captions_per_round"
        )
        room = scheduler.max_model_len - options.summary_tokens
        summary, rounds = await aggregate(
            host,
            processor,
            timeline,
            room,
            per_round,
            options.summary_tokens,
            options.max_in_flight,
            usage,
            on_event,
        )
    done = time.monotonic()
    timings = SummaryTimings(
        **stream.timings,
        caption_s=captioned - started,
        aggregate_s=done - captioned,
        total_s=done - started,
    )
    evs = request.evs
    return VideoSummary(
        timeline=tuple(timeline),
        summary=summary,
        chunk_s=plan.chunk_s,
        overlap_s=plan.overlap_s,
        sample_fps=plan.sample_fps,
        start_s=plan.start_s,
        end_s=plan.end_s,
        evs="off" if evs is None or evs.is_off else evs.key(),
        num_rounds=rounds,
        usage=usage,
        timings=timings,
    )


def _plan_event(plan: ChunkPlan) -> Event:
    return {
        "type": "plan",
        "num_chunks": len(plan.chunks),
        "num_cached": plan.num_cached,
        "chunk_s": plan.chunk_s,
        "overlap_s": plan.overlap_s,
        "sample_fps": plan.sample_fps,
        "start_s": plan.start_s,
        "end_s": plan.end_s,
    }


async def _caption(
    host: SummaryHost,
    processor: PromptProcessor,
    stream: ChunkStream,
    plan: ChunkPlan,
    options: SummaryOptions,
    usage: SummaryUsage,
    on_event: Callable[[Event], None],
) -> list[TimedCaption]:
    """Every chunk's caption, in order; encoding runs ahead while captions are written."""
    captions: list[TimedCaption | None] = [None] * len(plan.chunks)
    params = SamplingParams(max_tokens=options.caption_tokens)
    slots = asyncio.Semaphore(options.max_in_flight)

    async def caption(encoded, prompt: Prompt) -> None:
        try:
            output = await final_output(host, prompt, params)
        finally:
            slots.release()
        chunk = encoded.chunk
        captions[chunk.index] = TimedCaption(chunk.start_s, chunk.end_s, one_line(output.text))
        usage.add_output(output)
        on_event(
            {
                "type": "chunk",
                "index": chunk.index,
                "start_s": chunk.start_s,
                "end_s": chunk.end_s,
                "caption": captions[chunk.index].text,
                "num_done": sum(c is not None for c in captions),
                "num_chunks": len(captions),
            }
        )

    def prompts_of(batch) -> list[Prompt]:
        return [
            processor.build(chunk_caption_messages(e.chunk.start_s, e.chunk.end_s), [e.item])
            for e in batch
        ]

    async def produce(group: asyncio.TaskGroup) -> None:
        while (batch := await host.vision(stream.next_batch)) is not None:
            prompts = await host.text(lambda batch=batch: prompts_of(batch))
            for encoded, prompt in zip(batch, prompts, strict=True):
                usage.add_chunk(encoded.item, encoded.kept_whole)
                await slots.acquire()
                group.create_task(caption(encoded, prompt))

    await in_task_group(produce)
    assert all(c is not None for c in captions)
    return captions
