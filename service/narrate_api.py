"""Narration from Python: the WebSocket's `Narration`, fed from a file or an iterator of frames.

`narrate_frames` runs one `Narration` on a private event loop in a worker thread, over an
`AsyncEngine` lent the `LLMEngine` for the duration, and yields its segments as they come: the
same code and the same frames (sent losslessly, as PNG) as a WebSocket narration, so the two
give the same segments under lag `queue`. `realtime` paces frames at their timestamps; without
it, the feed waits while `FEED_AHEAD_TUBELETS` tubelets wait to be spoken about, so a model
slower than decoding does not queue up the whole video. Under `queue` it also waits (paced or
not) while the backlog is full (`max_queued_tubelets`), where a socket's frame is refused.
A file is decoded as it is narrated (`file_frames`, one frame ahead on a worker thread), so
memory does not grow with its length: there is no duration cap beyond the decode config's
safety caps, and the frame limit of a file's narration is what those caps admit at its rate
(`for_file`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import math
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from stillcut.engine.llm_engine import LLMEngine
from stillcut.service.async_engine import AsyncEngine
from stillcut.service.narrate_options import NarrateOptions
from stillcut.service.narration import Narration
from stillcut.vision.decode import DecodeConfig, open_video
from stillcut.vision.pipeline import VisionPipeline
from stillcut.vision.prefetch import prefetched

Frames = Iterable[tuple[float, np.ndarray]]  # (timestamp s, [H, W, 3] uint8 RGB)
FEED_AHEAD_TUBELETS = 4  # a feed without `realtime` waits while this many wait to be spoken
_DONE = object()


@dataclass(frozen=True)
class Segment:
    """What the model said about one tubelet: its frames' times, the text, the tubelets
    skipped before it (lag `latest`), its video tokens EVS kept, the tokens prefilled for it,
    the seconds from its tubelet's last frame to its first token, and whether the sequence
    rolled over before it."""

    t: tuple[float, float]
    text: str
    skipped: int
    kept_tokens: int
    prefill_tokens: int
    lag_s: float
    rolled_over: bool = False


class NarrationError(RuntimeError):
    """The narration stopped: the engine refused an append (the message says why)."""


def file_sampling(config: DecodeConfig, fps: float) -> DecodeConfig:
    """`config` sampling at `fps` with room for every sample: its frame cap raised to what its
    duration cap admits at `fps` (at most `max_decoded_frames`), so none are spread apart."""
    every_sample = min(math.ceil(config.max_duration_s * fps), config.max_decoded_frames)
    max_frames = max(config.max_frames, every_sample)
    return dataclasses.replace(config, fps=fps, max_frames=max_frames, num_frames=None)


def file_frames(path: Any, fps: float, config: DecodeConfig = DecodeConfig()) -> Frames:
    """Every frame of a video file sampled at `fps`, with its timestamp, at display size. Each
    is decoded as it is taken, the next one on a worker thread, so memory does not grow with
    the file's length; `config`'s safety caps apply (bytes, pixels, duration)."""
    with open_video(path, file_sampling(config, fps)) as reader:
        with prefetched(reader.frames()) as frames:
            for sampled in frames:
                for _ in range(sampled.num_samples):
                    yield sampled.time, sampled.rgb


def for_file(options: NarrateOptions, config: DecodeConfig) -> NarrateOptions:
    """`options` with a frame limit that admits every sample of a file `config` admits."""
    max_frames = max(options.limits.max_frames, file_sampling(config, options.fps).max_frames)
    limits = dataclasses.replace(options.limits, max_frames=max_frames)
    return dataclasses.replace(options, limits=limits)


def narrate_frames(
    engine: LLMEngine,
    pipeline: VisionPipeline,
    frames: Frames,
    options: NarrateOptions,
    *,
    realtime: bool = False,
) -> Iterator[Segment]:
    """Segments of a narration of `frames`, as they come; see the module docstring. Closing
    the iterator early ends the narration and frees its request."""
    out: queue.Queue = queue.Queue()
    stop = threading.Event()
    worker = threading.Thread(
        target=lambda: asyncio.run(_run(engine, pipeline, frames, options, realtime, out, stop)),
        name="stillcut-narrate",
        daemon=True,
    )
    worker.start()
    try:
        while (got := out.get()) is not _DONE:
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        stop.set()
        worker.join()


async def _run(engine, pipeline, frames, options, realtime, out, stop) -> None:
    async_engine = AsyncEngine(engine)
    rolled_over = False

    async def emit(message: dict) -> None:
        nonlocal rolled_over
        if message["type"] == "rollover":
            rolled_over = True
        elif message["type"] == "segment":
            t, text, skipped = tuple(message["t"]), message["text"], message["skipped"]
            kept, prefilled = message["kept_tokens"], message["prefill_tokens"]
            out.put(Segment(t, text, skipped, kept, prefilled, message["lag_s"], rolled_over))
            rolled_over = False
        elif message["type"] == "error":
            out.put(NarrationError(message["message"]))

    try:
        session = Narration(pipeline, async_engine, options, f"narrate-{uuid.uuid4().hex}", emit)
        try:
            await _feed(session, frames, realtime, stop)
            await session.drain()
        finally:
            await session.close()
    except BaseException as error:  # every failure reaches the caller
        out.put(error)
    finally:
        async_engine.shutdown()
        out.put(_DONE)


async def _feed(session: Narration, frames: Frames, realtime: bool, stop: threading.Event) -> None:
    start = time.monotonic()
    iterator = iter(frames)
    try:
        # taken off the event loop: a decoder or a camera may block
        while (got := await asyncio.to_thread(next, iterator, _DONE)) is not _DONE:
            if stop.is_set():
                return
            timestamp, frame = got
            if realtime:
                await asyncio.sleep(max(0.0, start + timestamp - time.monotonic()))
            # a full backlog would refuse the frame: an iterator is read later instead
            if session.backlog_full or (not realtime and session.num_ready >= FEED_AHEAD_TUBELETS):
                await session.drain()
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(frame)).save(buffer, format="PNG")
            await session.add_frame(float(timestamp), buffer.getvalue())
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:  # a file's decoder and its worker thread end here
            await asyncio.to_thread(close)
