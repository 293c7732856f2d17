"""Training clips for the demo: each scene rendered, compressed, decoded and resized as served.

A training scene is filmed at the model's sampling rate (2 fps), so every frame of its clip is
a sampled frame and rendering, encoding and decoding cost a quarter of an 8 fps clip; the
motion, timing and compression settings are the scene's own. The clip goes through stillcut's
own decoder, then each frame is resized with PIL's bicubic filter to the size the checkpoint's
preprocessor config picks, which is what `preprocess_video` does first; the resized frames are
kept as uint8 (a 12-frame clip at 112x84 is 0.3 MB), so training patchifies them through
`preprocess_video` again for free (a frame already at the target size is not resized).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image

from stillcut.demo.clips import clip_bytes
from stillcut.demo.scenes import Scene, SceneMix, sample_scene
from stillcut.demo.token_labels import token_labels
from stillcut.engine.models.qwen2_vl.preprocess import VideoPreprocessConfig, smart_resize
from stillcut.vision.decode import DecodeConfig, decode_video

SAMPLE_FPS = DecodeConfig().fps  # what describe samples at


@dataclass(frozen=True)
class TrainingClip:
    """One scene, its sampled frames [T, H, W, 3] uint8 at the model's input size, and what
    each of its merged video tokens shows ([t, h, w, 4], `token_labels`)."""

    scene: Scene
    frames: np.ndarray
    labels: np.ndarray


def model_frames(data: bytes, config: VideoPreprocessConfig) -> np.ndarray:
    """Decode a clip at the service's sampling rate; resize its frames as the preprocessor
    does. Returns [T, H, W, 3] uint8 at the size `config` picks."""
    decoded = decode_video(data, DecodeConfig())
    height, width = smart_resize(
        decoded.height, decoded.width, config.factor, config.min_pixels, config.max_pixels
    )
    resized = [
        Image.fromarray(frame).resize((width, height), resample=Image.Resampling.BICUBIC)
        for frame in decoded.frames
    ]
    return np.stack([np.asarray(image) for image in resized])


def training_clips(
    seeds: Sequence[int],
    config: VideoPreprocessConfig,
    *,
    mix: SceneMix = SceneMix(),
    log_every: int = 500,
    workers: int = 1,
) -> list[TrainingClip]:
    """The training scenes of `seeds` in `mix`, filmed at the sampling rate and prepared for
    the model, in order. With `workers` > 1 they are rendered by that many processes: each clip
    depends on its seed alone (x264 runs single-threaded), so the clips are the same."""
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    seeds, clips, started = list(seeds), [], time.perf_counter()
    batches = [seeds[start : start + _BATCH] for start in range(0, len(seeds), _BATCH)]
    with contextlib.ExitStack() as stack:
        rendered: Iterable[list[TrainingClip]] = map(
            _render, batches, itertools.repeat(config), itertools.repeat(mix)
        )
        if workers > 1 and len(batches) > 1:
            context = multiprocessing.get_context("spawn")  # no forked OpenMP state
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=context))
            rendered = pool.map(_render, batches, itertools.repeat(config), itertools.repeat(mix))
        for batch in rendered:
            done = len(clips)
            clips += batch
            if log_every and len(clips) // log_every > done // log_every:
                print(f"  {len(clips)} clips, {time.perf_counter() - started:.0f} s", flush=True)
    return clips


_BATCH = 50  # clips a rendering process prepares per task


def _render(seeds: list[int], config: VideoPreprocessConfig, mix: SceneMix) -> list[TrainingClip]:
    clips = []
    for seed in seeds:
        scene = sample_scene(seed, fps=round(SAMPLE_FPS), mix=mix)
        frames = model_frames(clip_bytes(scene), config)
        times = [k / SAMPLE_FPS for k in range(len(frames))]  # every frame is a sampled one
        grid = (frames.shape[1] // config.factor, frames.shape[2] // config.factor)
        clips.append(TrainingClip(scene, frames, token_labels(scene, times, grid)))
    return clips
