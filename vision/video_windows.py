"""A video file through decode -> preprocess -> tower -> EVS a bounded window at a time.

Sampled frames are grouped into windows of whole tubelets (an even number of frames: every
family's tubelet is one or two frames, and each tubelet is encoded on its own, so windows give
the embeddings the whole clip gives). A worker thread decodes the next window while this one
is preprocessed and encoded (`prefetch`). A window's frames and patches are dropped once its
embeddings exist; what outlives it depends on what the clip costs:

- dense embeddings (before EVS) when the whole clip's fit the encoder cache, which then holds
  them, so asking again with any EVS setting never decodes again; memory is what the cache
  may hold anyway;
- otherwise only what EVS keeps (`ClipPruner`: exact in rate mode, since the kept count is
  known from the plan), and nothing is cached.

So peak memory is one window (plus one decoding ahead) plus the kept tokens, not the duration.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from stillcut.engine.models.frame_resize import FrameResize
from stillcut.engine.multimodal import TowerOutput
from stillcut.kernels.evs import EVSConfig
from stillcut.kernels.evs.clip_pruner import ClipKept, ClipPruner
from stillcut.vision.decode import VideoProbe, VideoReader
from stillcut.vision.frame_pass import SampledFrame
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


def encode_windows(
    pipeline, media, reader: VideoReader, evs: EVSConfig | None, resize: FrameResize | None
) -> WindowedVideo:
    """Run `reader`'s clip through `pipeline`'s tower a window of `pipeline.window_frames` at a
    time, frames resized at decode by `resize` and preprocessed by `media` (the family's, with
    the request's pixel budget)."""
    probe = reader.probe
    window_frames = pipeline.window_frames
    sink: _Sink | None = None
    timestamps: list[float] = []
    timings = {"decode_s": 0.0, "preprocess_s": 0.0, "encode_s": 0.0}
    samples = reader.frames(resize=resize, work=pipeline.work)
    with prefetched(frame_windows(samples, window_frames)) as windows:
        for window in windows:
            started = time.perf_counter()
            told = {} if resize is None else resize.prepare_options(window.display_size)
            prepared = media.prepare_video(window.frames, probe.sample_fps, **told)
            prepared_at = time.perf_counter()
            pipeline.work.tower_passes += 1
            (output,) = pipeline.encode_prepared([prepared])
            if sink is None:
                sink = _Sink.start(pipeline, media, probe, prepared, window, output, evs)
            sink.push(output)
            timestamps.extend(window.timestamps)
            timings["decode_s"] += window.decode_s
            timings["preprocess_s"] += prepared_at - started
            timings["encode_s"] += time.perf_counter() - prepared_at
    assert sink is not None  # a pass yields a frame or raises
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

    @classmethod
    def start(
        cls, pipeline, media, probe: VideoProbe, prepared, window, output: TowerOutput, evs
    ) -> _Sink:
        """Size the clip from its plan and its first window; keep it dense if the encoder
        cache can hold it."""
        merge = media.merge_size
        _, height, width = prepared.grid_thw
        frames_high, frames_wide = window.frames.shape[1:3]
        num_tubelets = media.token_grid("video", probe.num_samples, frames_high, frames_wide)[0]
        num_tokens = num_tubelets * (height // merge) * (width // merge)
        sink = cls((num_tubelets, height, width), prepared, window, None)
        sink.names = tuple(sorted(output.features))
        like = sink.row_sets(output)
        row_bytes = sum(t.shape[1] * t.element_size() for t in like)
        if num_tokens * row_bytes > pipeline.cache.max_bytes:
            sink.pruner = ClipPruner(evs, (height // merge, width // merge), num_tubelets)
            return sink
        sink.dense = [t.new_empty((num_tokens, t.shape[1])) for t in like]
        return sink

    def row_sets(self, output: TowerOutput) -> list[torch.Tensor]:
        """A window's embeddings, then its feature sets in `names` order."""
        return [output.embeds, *(output.features[name] for name in self.names)]

    def push(self, output: TowerOutput) -> None:
        parts = self.row_sets(output)
        if self.pruner is not None:
            self.pruner.push(*parts)
            return
        rows = slice(self._num_rows, self._num_rows + parts[0].shape[0])
        for whole, part in zip(self.dense, parts, strict=True):
            whole[rows] = part
        self._num_rows = rows.stop

    def finish(self, timestamps: tuple[float, ...], timings: dict) -> WindowedVideo:
        kept = None
        if self.pruner is None:
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
