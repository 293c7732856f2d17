"""Decode-and-sample speed: stillcut's `decode_video` vs decoding every frame to RGB.

Once per run, a 1280x720, 30 fps libx264 clip of a panning noise texture with a colour
gradient is written to a temporary folder (preset veryfast, which keeps CABAC and B-frames;
the encoder's default GOP). Each path then samples it at 2 fps, and the timed runs alternate
between the paths so machine noise hits all alike; the table shows medians.

- naive: decode every frame to an RGB array (PyAV defaults, as ours), then pick the sampled
  frames by the same rule. Its output is checked equal to ours.
- stillcut: `decode_video`, which converts only the frames it keeps.
- with preprocess: each of the two plus `preprocess_video` on the sampled frames (the issue's
  decode+sample+preprocess path, against the naive path doing the same preprocessing).

    python bench/decode.py [--seconds 30] [--runs 5] [--fps 2]
"""

import argparse
import bisect
import statistics
import tempfile
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from stillcut.engine.models.qwen2_vl.preprocess import VideoPreprocessConfig, preprocess_video
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.sampling import TIME_EPS_S, plan_samples
from stillcut.vision.synthetic import moving_texture, write_video

NAIVE = "naive: every frame to RGB, then sample"
NAIVE_PRE = "naive + preprocess_video"
OURS_PRE = "stillcut decode_video + preprocess_video"

WIDTH, HEIGHT, RATE = 1280, 720, 30


def write_clip(path: Path, seconds: float) -> None:
    num_frames = round(seconds * RATE)
    frames = moving_texture(num_frames, WIDTH, HEIGHT)
    write_video(path, frames, time_base=Fraction(1, RATE), options={"preset": "veryfast"})


def naive_decode(path: Path, config: DecodeConfig) -> np.ndarray:
    """Every frame to RGB first, then the same sampling rule over the list."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames, times = [], []
        for frame in container.decode(stream):
            frames.append(frame.to_ndarray(format="rgb24"))  # [H, W, 3]
            times.append(float(frame.pts * stream.time_base))
        duration = float(stream.duration * stream.time_base)
    plan = plan_samples(0.0, duration, config.fps, config.max_frames)
    picked = [max(0, bisect.bisect_right(times, t + TIME_EPS_S) - 1) for t in plan.times]
    return np.stack([frames[i] for i in picked])  # [T, H, W, 3]


def measure(paths: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(runs):
        for name, run in paths.items():
            began = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - began)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="clip length")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per path")
    parser.add_argument("--fps", type=float, default=2.0, help="sampling rate")
    args = parser.parse_args()
    config = DecodeConfig(fps=args.fps)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "clip.mp4"
        began = time.perf_counter()
        write_clip(path, args.seconds)
        size_mb = path.stat().st_size / 2**20
        print(f"clip: {WIDTH}x{HEIGHT}, {args.seconds:g} s at {RATE} fps, {size_mb:.1f} MiB, "
              f"written in {time.perf_counter() - began:.1f} s")  # fmt: skip

        ours = decode_video(path, config)
        np.testing.assert_array_equal(ours.frames, naive_decode(path, config))
        print(f"sampled {len(ours.frames)} frames at {ours.sample_fps:g} fps; naive output equal")

        paths: dict[str, Callable[[], object]] = {
            NAIVE: lambda: naive_decode(path, config),
            "stillcut decode_video": lambda: decode_video(path, config),
        }
        preprocess_config = VideoPreprocessConfig()

        def naive_with_preprocess() -> object:
            return preprocess_video(naive_decode(path, config), args.fps, preprocess_config)

        def ours_with_preprocess() -> object:
            video = decode_video(path, config)
            return preprocess_video(video.frames, video.sample_fps, preprocess_config)

        paths[NAIVE_PRE] = naive_with_preprocess
        paths[OURS_PRE] = ours_with_preprocess

        medians = measure(paths, args.runs)

    num_frames = round(args.seconds * RATE)
    print(f"\nmedian of {args.runs} interleaved runs; frames/s: clip frames per wall second;")
    print("speedup against the naive path doing the same work (with or without preprocessing)")
    print(f"{'path':<44} {'median s':>9} {'frames/s':>9} {'speedup':>8}")
    for name, median_s in medians.items():
        baseline = medians[NAIVE_PRE if "preprocess" in name else NAIVE]
        print(f"{name:<44} {median_s:>9.3f} {num_frames / median_s:>9.0f} "
              f"{baseline / median_s:>7.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
