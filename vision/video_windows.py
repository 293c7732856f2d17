"""A video file through decode -> preprocess -> tower -> EVS a bounded window at a time.

Sampled frames are grouped into windows of whole tubelets (an even number of frames: every
family's tubelet is one or two frames, and each tubelet is encoded on its own, so windows give
the embeddings the whole clip gives). A worker thread decodes the next window while this one
is preprocessed and encoded (`prefetch`). A window's frames and patches are dropped once its
embeddings exist; what outlives it depends on what the clip costs:

- dense embeddings (before EVS) when the whole clip's fit the encoder cache, which then holds
  them, so asking again with any setting of EVS after the tower never decodes again; memory
  is what the cache may hold anyway;
- otherwise only what EVS keeps (`ClipPruner`: exact in rate mode, since the kept count is
  known from the plan), and nothing is cached.

EVS before the tower (`pixel_stage`) decides per window which tokens the tower encodes, so only
kept tokens ever exist (the encoder cache then holds them). In threshold mode that is causal;
rate mode ranks the whole clip, so the clip is read twice: a first pass scores every window's
pixels (no tower), the second encodes the kept tokens.

So peak memory is one window (plus one decoding ahead) plus the kept tokens, not the duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from stillcut.engine.models.frame_resize import FrameResize
from stillcut.engine.multimodal import TowerOutput
from stillcut.kernels.evs import EVSConfig, EVSResult
from stillcut.kernels.evs.clip_pruner import ClipKept, ClipPruner
from stillcut.vision.decode import VideoProbe, VideoReader
from stillcut.vision.frame_pass import SampledFrame
from stillcut.vision.pixel_stage import PixelScores, WindowPixels, pixel_evs
from stillcut.vision.prefetch import prefetched


@dataclass(frozen=True)
class FrameWindow:
    """Consecutive sampled frames, a whole number of tubelets (the last may be short)."""

    frames: np.ndarray  # [n, H, W, 3] uint8 at the resize target
    timestamps: list[float]
    display_size: tuple[int, int]  # (height, width) of the source, upright, before resizing
    decode_s: float  # time the decoder spent on it


# A window also ends, on a tubelet boundary, once its frames hold this many bytes: frames held
# at display size (a family without a resize at decode) must not make a window huge.
WINDOW_BYTES = 64 << 20


def frame_windows(samples: Iterator[SampledFrame], window_frames: int) -> Iterator[FrameWindow]:
    """Group the sampled frames (a frame filling k slots counts k times) into windows of
    `window_frames`, or fewer (an even number) reaching `WINDOW_BYTES`."""
    frames: list[np.ndarray] = []
    times: list[float] = []
    started = time.perf_counter()
    for sampled in samples:
        for _ in range(sampled.num_samples):
            frames.append(sampled.rgb)
            times.append(sampled.time)
            heavy = len(frames) % 2 == 0 and len(frames) * sampled.rgb.nbytes >= WINDOW_BYTES
            if len(frames) == window_frames or heavy:
                yield FrameWindow(
                    np.stack(frames), times, sampled.display_size, time.perf_counter() - started
                )
                frames, times = [], []
                started = time.perf_counter()
    if frames:
        yield FrameWindow(
            np.stack(frames), times, sampled.display_size, time.perf_counter() - started
        )


@dataclass
class WindowedVideo:
    """What the windows left: dense embeddings or what EVS kept, and the clip's facts."""

    grid_thw: tuple[int, int, int]  # pre-merge patch grid of the whole clip
    second_per_grid_ts: float
    timestamps: tuple[float, ...]
    resized_size: tuple[int, int]  # (height, width) the model saw
    display_size: tuple[int, int]
    # the clip's dense embeddings and feature sets, or (with `kept`) the rows EVS kept
    output: TowerOutput
    kept: ClipKept | None
    timings: dict[str, float]


Reopen = Callable[[], AbstractContextManager[VideoReader]]


def encode_windows(
    pipeline,
    media,
    reader: VideoReader,
    evs: EVSConfig | None,
    resize: FrameResize | None,
    reopen: Reopen,
) -> WindowedVideo:
    """Run `reader`'s clip through `pipeline`'s tower a window of `pipeline.window_frames` at a
    time, frames resized at decode by `resize` and preprocessed by `media` (the family's, with
    the request's pixel budget). `reopen` opens the clip afresh (rate mode before the tower
    reads it twice)."""
    timings = {"decode_s": 0.0, "preprocess_s": 0.0, "encode_s": 0.0, "evs_s": 0.0}
    pixel = pixel_evs(evs)
    if pixel is None or pixel.mode == "threshold":
        pixels = None if pixel is None else WindowPixels(pixel)
        return _encode(pipeline, media, reader, evs, resize, pixels, timings)
    scores = None
    for window, prepared in _prepared_windows(pipeline, media, reader, resize, timings):
        started = time.perf_counter()
        if scores is None:
            scores = PixelScores(pixel, clip_grid(media, reader.probe, prepared, window))
        scores.push(media, prepared)
        timings["evs_s"] += time.perf_counter() - started
    assert scores is not None  # a pass yields a frame or raises
    with reopen() as again:
        return _encode(
            pipeline, media, again, evs, resize, WindowPixels(pixel, scores.mask()), timings
        )


def clip_grid(media, probe: VideoProbe, prepared, window: FrameWindow) -> tuple[int, int, int]:
    """The whole clip's token grid (t, h, w), from its plan and its first window."""
    _, height, width = prepared.grid_thw
    frames_high, frames_wide = window.frames.shape[1:3]
    num_tubelets = media.token_grid("video", probe.num_samples, frames_high, frames_wide)[0]
    return num_tubelets, height // media.merge_size, width // media.merge_size


def _prepared_windows(pipeline, media, reader: VideoReader, resize, timings: dict):
    """Each window and its preprocessed input, decode and preprocess time added to `timings`."""
    probe = reader.probe
    samples = reader.frames(resize=resize, work=pipeline.work)
    with prefetched(frame_windows(samples, pipeline.window_frames)) as windows:
        for window in windows:
            started = time.perf_counter()
            told = {} if resize is None else resize.prepare_options(window.display_size)
            prepared = media.prepare_video(window.frames, probe.sample_fps, **told)
            timings["decode_s"] += window.decode_s
            timings["preprocess_s"] += time.perf_counter() - started
            yield window, prepared


def _encode(
    pipeline, media, reader, evs, resize, pixels: WindowPixels | None, timings: dict
) -> WindowedVideo:
    """The encoding pass: each window through the tower (with `pixels`, its kept tokens only)."""
    sink: _Sink | None = None
    timestamps: list[float] = []
    for window, prepared in _prepared_windows(pipeline, media, reader, resize, timings):
        started = time.perf_counter()
        chosen = None if pixels is None else pixels.push(media, prepared)
        encode_at = time.perf_counter()
        timings["evs_s"] += encode_at - started
        if chosen is None or chosen.num_kept_tokens:  # an emptied window adds nothing
            pipeline.work.tower_passes += 1
            (output,) = pipeline.encode_prepared(
                [prepared], [None if chosen is None else chosen.mask]
            )
            if sink is None:
                sink = _Sink.start(pipeline, media, reader.probe, prepared, window, output, evs)
            sink.push(output, chosen)
        else:
            sink.push_empty(chosen)
        timestamps.extend(window.timestamps)
        timings["encode_s"] += time.perf_counter() - encode_at
    assert sink is not None  # a pass yields a frame or raises; the first tubelet is kept whole
    return sink.finish(tuple(timestamps), timings)


class _Sink:
    """Where windows' embeddings go: written into the clip's dense tensors (allocated once at
    their final size, so finishing copies nothing), or through the clip's pruner."""

    def __init__(self, grid, prepared, window, pruner: ClipPruner | None) -> None:
        self.grid_thw = grid
        self.second_per_grid_ts = prepared.second_per_grid_ts
        self.resized_size = (prepared.resized_height, prepared.resized_width)
        self.display_size = window.display_size
        self.pruner = pruner
        self.names: tuple[str, ...] = ()  # the feature sets, in row-set order after embeds
        self.dense: list[torch.Tensor] = []  # embeds, then each feature set: [clip tokens, dim]
        self._num_rows = 0  # rows written so far
        # pruned before the tower: per window its kept rows (row sets), coordinates, counts
        self.kept_parts: list[list[torch.Tensor]] = []
        self.kept_coords: list[torch.Tensor] = []
        self.kept_counts: list[torch.Tensor] = []

    @classmethod
    def start(
        cls, pipeline, media, probe: VideoProbe, prepared, window, output: TowerOutput, evs
    ) -> _Sink:
        """Size the clip from its plan and its first window; keep it dense if the encoder
        cache can hold it."""
        _, height, width = prepared.grid_thw
        num_tubelets, rows, cols = clip_grid(media, probe, prepared, window)
        num_tokens = num_tubelets * rows * cols
        sink = cls((num_tubelets, height, width), prepared, window, None)
        sink.names = tuple(sorted(output.features))
        like = sink.row_sets(output)
        row_bytes = sum(t.shape[1] * t.element_size() for t in like)
        if pixel_evs(evs) is not None:  # only kept tokens are ever encoded
            return sink
        if num_tokens * row_bytes > pipeline.cache.max_bytes:
            sink.pruner = ClipPruner(evs, (rows, cols), num_tubelets)
            return sink
        sink.dense = [t.new_empty((num_tokens, t.shape[1])) for t in like]
        return sink

    def row_sets(self, output: TowerOutput) -> list[torch.Tensor]:
        """A window's embeddings, then its feature sets in `names` order."""
        return [output.embeds, *(output.features[name] for name in self.names)]

    def push(self, output: TowerOutput, chosen: EVSResult | None = None) -> None:
        """A window's tower output (with `chosen`: the tokens EVS before the tower kept)."""
        parts = self.row_sets(output)
        if chosen is not None:
            self.kept_parts.append(parts)
            self.push_empty(chosen)
            return
        if self.pruner is not None:
            self.pruner.push(*parts)
            return
        rows = slice(self._num_rows, self._num_rows + parts[0].shape[0])
        for whole, part in zip(self.dense, parts, strict=True):
            whole[rows] = part
        self._num_rows = rows.stop

    def push_empty(self, chosen: EVSResult) -> None:
        """What EVS before the tower chose in a window (no rows when it kept nothing)."""
        self.kept_coords.append(chosen.kept_coords)
        self.kept_counts.append(chosen.kept_per_tubelet)

    def finish(self, timestamps: tuple[float, ...], timings: dict) -> WindowedVideo:
        kept = None
        if self.kept_coords:
            rows = tuple(torch.cat(parts) for parts in zip(*self.kept_parts, strict=True))
            coords, counts = torch.cat(self.kept_coords), torch.cat(self.kept_counts)
            kept = ClipKept(rows, coords, counts)
        elif self.pruner is None:
            assert self._num_rows == self.dense[0].shape[0], (self._num_rows, self.dense[0].shape)
            rows = tuple(self.dense)
        else:
            kept = self.pruner.finish()
            rows = kept.rows
        output = TowerOutput(rows[0], dict(zip(self.names, rows[1:], strict=True)))
        return WindowedVideo(
            self.grid_thw, self.second_per_grid_ts, timestamps, self.resized_size,
            self.display_size, output, kept, timings,
        )  # fmt: skip
