"""A video file's chunks through the vision tower, a batch of chunks at a time.

`open` scans the file's packets (no decoding), chooses the chunk length (`chunks`) and looks
every chunk up in the encoder cache, where each chunk's embeddings (before EVS) live under a
key of their own: the file's content, the decode and preprocess settings and the chunk's range.
The file is then decoded once, from the first chunk the cache lacks to the last (not at all when
it holds every one): each sampled frame goes to the chunks whose samples include it, and a
chunk's frames leave the decoder's thread as soon as the chunk is complete. `next_batch`
preprocesses the chunks of up to one window of frames (`VisionPipeline.window_frames`) as videos
of their own and encodes them in one tower pass, while the next ones decode; each chunk's
embeddings go into the cache and the chunk becomes its own video item, pruned by EVS on its own.
Held at once: a batch of frames and patches, a batch decoding ahead, and what the cache holds.

The pipeline is not thread-safe: the caller runs `open` and `next_batch` one at a time (the
service on its vision worker). `close` may come from any thread; it waits for a batch in
progress, then stops the decoder.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace

import numpy as np

from stillcut.engine.multimodal import MultiModalItem
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.decode import VideoReader, open_video, source_indices
from stillcut.vision.encoder_cache import EncodedMedia
from stillcut.vision.pipeline import (
    VideoSource,
    VisionPipeline,
    media_key,
    own_tensors,
    video_payload,
)
from stillcut.vision.prefetch import prefetched
from stillcut.vision.summary.chunks import (
    Chunk,
    ChunkingError,
    ChunkLimits,
    chunk_evs,
    chunk_frames,
    overlap_frames,
    plan_chunks,
)
from stillcut.vision.video_plan import kept_range


@dataclass(frozen=True)
class ChunkRequest:
    """What to cut and encode: a video file (path, bytes or binary file object), its sampling
    (`fps`, [start, end) seconds, a pixel budget as (name, value) pairs), the chunk length
    (None: the longest that fits `limits`) and overlap, and the EVS setting of each chunk
    (`whole_short`: the setting is a default, and a chunk it would prune to about its first
    tubelet is kept whole, see `chunks.chunk_evs`)."""

    source: VideoSource
    evs: EVSConfig | None
    limits: ChunkLimits
    chunk_s: float | None = None
    overlap_s: float = 0.0
    fps: float | None = None
    start: float | None = None
    end: float | None = None
    pixels: tuple[tuple[str, int], ...] = ()
    max_chunks: int = 4096
    whole_short: bool = False


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one video, known before any decoding."""

    chunks: tuple[Chunk, ...]
    chunk_s: float
    overlap_s: float
    sample_fps: float
    start_s: float
    end_s: float
    num_cached: int  # chunks the encoder cache already holds


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk and its video item (pruned; `kept_whole`: by the short-chunk rule)."""

    chunk: Chunk
    item: MultiModalItem
    kept_whole: bool = False


@dataclass(frozen=True)
class _ChunkFrames:
    chunk: Chunk
    frames: np.ndarray  # [n, H, W, 3] uint8, held at the resize target
    timestamps: tuple[float, ...]  # each sample's frame time
    display_size: tuple[int, int]
    decode_s: float


class ChunkStream:
    """The chunks of `request` through `pipeline` (see the module docstring)."""

    def __init__(self, pipeline: VisionPipeline, request: ChunkRequest) -> None:
        self.pipeline = pipeline
        self.request = request
        self.media = pipeline.media_with(request.pixels)
        self.plan: ChunkPlan | None = None
        self.timings = {"decode_s": 0.0, "preprocess_s": 0.0, "encode_s": 0.0}
        self._lock = threading.Lock()
        self._exits = ExitStack()
        self._keys: list[str] = []
        self._hits: dict[int, EncodedMedia] = {}
        self._decoded: Iterator[_ChunkFrames] = iter(())
        self._reader_facts: dict = {}
        self._size = (0, 0)  # the video's height and width
        self._next = 0  # the next chunk to hand out
        self._closed = False

    def open(self) -> ChunkPlan:
        """Scan the file, plan the chunks and look them up in the encoder cache; start decoding
        what it lacks. Raises the decoder's `VideoError`s, and `ChunkingError` for chunks that
        cannot be (naming what would)."""
        with self._lock:
            request = self.request
            digest, data = video_payload(request.source, self.pipeline.decode_config.max_bytes)
            defaults = self.pipeline.decode_config
            config = defaults.with_sampling(request.fps, defaults.max_decoded_frames)
            reader = self._exits.enter_context(
                open_video(data, config, start=request.start, end=request.end)
            )
            probe = reader.probe
            self._size = (probe.height, probe.width)
            plan = self._plan(reader)
            preprocess = self.media.video_preprocess.key()
            for chunk in plan.chunks:
                params = {"kind": "video-chunk", "decode": repr(config), "preprocess": preprocess}
                params |= {"start": chunk.start_s, "end": chunk.end_s}
                self._keys.append(media_key(self.pipeline.model_key, digest, params))
                encoded = self.pipeline.cached(self._keys[-1])
                if encoded is not None:
                    self._hits[chunk.index] = encoded
            self.plan = replace(plan, num_cached=len(self._hits))
            self._reader_facts = {"codec": probe.codec, "source_fps": probe.source_fps}
            self._start_decoding(reader, data, config)
            return self.plan

    def next_batch(self) -> list[EncodedChunk] | None:
        """The next chunks, in order, up to one window of frames; None after the last."""
        with self._lock:
            assert self.plan is not None, "open() first"
            chunks = self.plan.chunks
            if self._closed or self._next == len(chunks):
                return None
            batch: list[tuple[Chunk, EncodedMedia | _ChunkFrames]] = []
            num_frames = 0
            while self._next < len(chunks) and num_frames < self.pipeline.window_frames:
                chunk = chunks[self._next]
                hit = self._hits.pop(chunk.index, None)
                batch.append((chunk, hit if hit is not None else self._frames_of(chunk)))
                num_frames += chunk.num_samples
                self._next += 1
            return self._encoded(batch)

    def close(self) -> None:
        """Stop decoding and let go of the file (waits for a batch in progress)."""
        with self._lock:
            self._closed = True
            self._hits.clear()
            self._exits.close()

    def _plan(self, reader: VideoReader) -> ChunkPlan:
        request, probe = self.request, reader.probe

        def tokens_of(num_frames: int) -> int:
            return kept_range(*self._grid_and_evs(num_frames))[1]

        fps = probe.sample_fps
        frames = chunk_frames(request.chunk_s, fps, request.limits, tokens_of)
        overlap = overlap_frames(request.overlap_s, fps, frames)
        end_s = probe.start + probe.duration
        chunks = plan_chunks(probe.sample_times, probe.start, end_s, fps, frames, frames - overlap)
        if len(chunks) > request.max_chunks:
            raise ChunkingError(
                f"the video gives {len(chunks)} chunks of {frames / fps:g} s; at most "
                f"max_chunks={request.max_chunks}: use a longer chunk_s or a shorter range"
            )
        return ChunkPlan(tuple(chunks), frames / fps, overlap / fps, fps, probe.start, end_s, 0)

    def _start_decoding(self, reader: VideoReader, data, config) -> None:
        """Decode from the first chunk the cache lacks to the last (on a worker thread)."""
        missing = [chunk for chunk in self.plan.chunks if chunk.index not in self._hits]
        if not missing:
            self._exits.close()  # nothing to decode
            return
        first, last = missing[0], missing[-1]
        if first.index > 0 or last.index < len(self.plan.chunks) - 1:
            self._exits.close()  # a narrower range: scan it afresh
            reader = self._exits.enter_context(
                open_video(data, config, start=first.start_s, end=last.end_s)
            )
        resize = self.media.frame_resize
        if resize is not None and config.resize == "fast":
            resize = replace(resize, fast=True)
        samples = reader.frames(resize=resize, work=self.pipeline.work)
        wanted = [c for c in self.plan.chunks if first.index <= c.index <= last.index]
        depth = max(1, self.pipeline.window_frames // max(1, first.num_samples))
        self._decoded = self._exits.enter_context(
            prefetched(_chunk_frames(samples, wanted, first.first_sample), depth=depth)
        )

    def _frames_of(self, chunk: Chunk) -> _ChunkFrames:
        for decoded in self._decoded:  # chunks the cache holds inside the range pass by
            if decoded.chunk.index == chunk.index:
                return decoded
        raise AssertionError(f"the decoder ended before chunk {chunk.index}")

    def _encoded(
        self, batch: list[tuple[Chunk, EncodedMedia | _ChunkFrames]]
    ) -> list[EncodedChunk]:
        """Encode the batch's decoded chunks in one tower pass; every chunk's item."""
        fresh = [(chunk, got) for chunk, got in batch if isinstance(got, _ChunkFrames)]
        started = time.perf_counter()
        resize = self.media.frame_resize
        prepared = []
        for _, decoded in fresh:
            told = {} if resize is None else resize.prepare_options(decoded.display_size)
            fps = self.plan.sample_fps
            prepared.append(self.media.prepare_video(decoded.frames, fps, **told))
        prepared_at = time.perf_counter()
        outputs = self.pipeline.encode_prepared(prepared) if prepared else []
        if prepared:
            self.pipeline.work.tower_passes += 1
        encode_s = time.perf_counter() - prepared_at
        self.timings["preprocess_s"] += prepared_at - started
        self.timings["encode_s"] += encode_s
        encoded: dict[int, tuple[EncodedMedia, dict]] = {}
        for (chunk, decoded), patches, output in zip(fresh, prepared, outputs, strict=True):
            media = self._media_of(chunk, decoded, patches, output, len(fresh))
            self.pipeline.store(self._keys[chunk.index], media)
            self.timings["decode_s"] += decoded.decode_s
            timings = {
                "decode_s": decoded.decode_s,
                "preprocess_s": (prepared_at - started) / len(fresh),
                "encode_s": encode_s / len(fresh),
            }
            encoded[chunk.index] = (media, timings)
        items = []
        for chunk, got in batch:
            media, timings = encoded.get(chunk.index, (got, None))
            evs = self._grid_and_evs(chunk.num_samples)[1]
            item = self.pipeline.item_of(self._keys[chunk.index], media, evs, timings)
            # chunk_evs hands back the request's own setting unless it keeps the chunk whole
            items.append(EncodedChunk(chunk, item, kept_whole=evs is not self.request.evs))
        return items

    def _grid_and_evs(self, num_frames: int) -> tuple[tuple[int, int, int], EVSConfig | None]:
        """A chunk of `num_frames` samples: its token grid and its EVS setting."""
        grid = self.media.token_grid("video", num_frames, *self._size)
        return grid, chunk_evs(self.request.evs, grid, self.request.whole_short)

    def _media_of(self, chunk: Chunk, decoded: _ChunkFrames, patches, output, batch_size: int):
        output = own_tensors(output, batch_size)
        source_fps = self._reader_facts["source_fps"]
        height, width = decoded.display_size
        info = {
            **self._reader_facts,
            "sample_fps": self.plan.sample_fps,
            "duration": chunk.end_s - chunk.start_s,
            "start": chunk.start_s,
            "end": chunk.end_s,
            "width": width,
            "height": height,
            "resized_width": patches.resized_width,
            "resized_height": patches.resized_height,
            **({"pixel_budget": self.media.pixel_budget()} if self.request.pixels else {}),
        }
        return EncodedMedia(
            output.embeds,
            patches.grid_thw,
            patches.second_per_grid_ts,
            decoded.timestamps,
            info,
            source_indices=source_indices(decoded.timestamps, source_fps),
            source_fps=source_fps,
            features=output.features,
        )


def _chunk_frames(samples, chunks: list[Chunk], offset: int) -> Iterator[_ChunkFrames]:
    """Each of `chunks` (in order) with its frames, as soon as its last sample is decoded;
    `samples` are the sampled frames from sample `offset` on."""
    held: deque[tuple[np.ndarray, float]] = deque()  # samples from `first_held` on
    first_held = offset
    pending = deque(chunks)
    index = offset
    started = time.perf_counter()
    for sampled in samples:
        for _ in range(sampled.num_samples):
            held.append((sampled.rgb, sampled.time))
            index += 1
            while pending and pending[0].stop_sample == index:
                chunk = pending.popleft()
                own = list(held)[chunk.first_sample - first_held :]
                frames = np.stack([rgb for rgb, _ in own])
                times = tuple(t for _, t in own)
                decode_s = time.perf_counter() - started
                yield _ChunkFrames(chunk, frames, times, sampled.display_size, decode_s)
                started = time.perf_counter()
                keep_from = pending[0].first_sample if pending else index
                while first_held < keep_from and held:
                    held.popleft()
                    first_held += 1
