"""Long video: sampling speed and memory beside the best decoders, and the token plan.

Makes its own 720p H.264 files (30 fps, a keyframe every 250 frames, B-frames; simple content
at a tiny bitrate so they are cheap to make): a base clip encoded once, and longer ones remuxed
from copies of its packets (no re-encoding), cached under bench/out/long_video. Then:

1. sampling at each `--fps` (default 1 and 0.1) to the demo model's frame size (252x140):
   stillcut (exact resize: the model processor's PIL bicubic; fast: FFmpeg's scaler at decode)
   against a plain PyAV loop (`thread_type="AUTO"`, `to_ndarray(width=, height=)`), OpenCV
   (`grab` / `retrieve` + `cv2.resize`) and decord2 (`get_batch`); each run in a fresh process
   (its peak RSS is its own), modes interleaved round by round, medians of `--rounds`;
2. peak RSS of `stillcut inspect` (demo model, 1 fps, EVS off and rate 0.75) on each length;
3. `stillcut inspect --plan` time on the longest file, and on the shortest whether the plan's
   rate-mode token count equals what encoding then keeps;
4. fast against exact resize: the relative difference of the tower's embeddings and how many
   of the tokens EVS keeps (rate 0.75) both keep, on the first minute.

OpenCV and decord2 come from the `bench` extra (`pip install -e .[bench]`); a missing peer is
skipped. Usage: python bench/long_video.py [--minutes 10 60] [--rounds 5] [--fps 1 0.1]

`--summarize` measures long-video summaries instead: `stillcut summarize` (demo model, 2 fps,
`--chunk-s` seconds per chunk, default 4, the demo's trained length) on each length end to end,
each run a fresh process, lengths interleaved round by round: chunks captioned per second of
the summary's wall time, and peak RSS, the longest clip's against the shortest's (the target:
60 minutes <= 1.25x 10 minutes). The clips are outside the demo's task: the captions mean
nothing, the work is real.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np

OUT = Path(__file__).parent / "out" / "long_video"
WIDTH, HEIGHT, RATE, KEYINT = 1280, 720, 30, 250
TARGET = (140, 252)  # (height, width): the demo model's smart resize of 720p
PEERS = ("pyav", "opencv", "decord2")
MODES = ("stillcut-exact", "stillcut-fast", *PEERS)


def base_clip(minutes: float) -> Path:
    """The encoded clip every longer one is built from (made once, cached)."""
    path = OUT / f"base_{minutes:g}min_720p.mp4"
    if path.exists():
        return path
    OUT.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.mp4")
    options = {"preset": "ultrafast", "crf": "40", "x264-params": f"keyint={KEYINT}:bframes=2"}
    ramp = np.linspace(16, 235, WIDTH, dtype=np.uint8)[None, :].repeat(HEIGHT, 0)  # [H, W]
    chroma = np.full((HEIGHT // 2, WIDTH), 128, np.uint8)  # U and V planes, stacked
    with av.open(str(partial), "w") as container:
        stream = container.add_stream("libx264", rate=RATE, options=options)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for index in range(round(minutes * 60 * RATE)):
            luma = np.roll(ramp, 4 * index, axis=1)
            x = (7 * index) % (WIDTH - 160)
            luma[280:440, x : x + 160] = 235 - (index // RATE) % 200  # a square, shade by second
            frame = av.VideoFrame.from_ndarray(np.concatenate((luma, chroma)), format="yuv420p")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    partial.rename(path)
    return path


def long_clip(minutes: float, base_minutes: float) -> Path:
    """`minutes` of video: the base clip's packets repeated, timestamps shifted."""
    base = base_clip(base_minutes)
    copies = round(minutes / base_minutes)
    if copies == 1:
        return base
    path = OUT / f"long_{minutes:g}min_720p.mp4"
    if path.exists():
        return path
    partial = path.with_suffix(".partial.mp4")
    with av.open(str(base)) as source, av.open(str(partial), "w") as target:
        video = source.streams.video[0]
        stream = target.add_stream_from_template(video)
        span = round(base_minutes * 60 / video.time_base)
        for copy in range(copies):
            source.seek(0, stream=video)
            for packet in source.demux(video):
                if packet.size == 0:
                    continue
                packet.pts += copy * span
                packet.dts += copy * span
                packet.stream = stream
                target.mux(packet)
    partial.rename(path)
    return path


def _sample_times(duration: float, fps: float) -> list[float]:
    return [k / fps for k in range(int(duration * fps))]


def run_mode(mode: str, path: str, fps: float) -> dict:
    """Sample `path` at `fps` to the target size with `mode`; the frames' checksum and count.
    Imports and setup happen before the clock starts."""
    sampler = SAMPLERS[mode]()
    started = time.perf_counter()
    checksum, count = 0, 0
    for rgb in sampler(path, fps):
        assert rgb.shape == (*TARGET, 3), rgb.shape
        checksum += int(rgb[::16, ::16].sum())
        count += 1
    return {"seconds": time.perf_counter() - started, "frames": count, "checksum": checksum}


def _stillcut(fast: bool):
    """The demo model's resize at decode (exact: PIL bicubic as its processor; or fast)."""
    from dataclasses import replace

    from stillcut.demo import demo_checkpoint
    from stillcut.engine.checkpoint import load_model_config
    from stillcut.engine.models.qwen2_vl.media import QwenMedia
    from stillcut.vision.decode import DecodeConfig, open_video

    checkpoint = demo_checkpoint()
    resize = QwenMedia(checkpoint, load_model_config(checkpoint)).frame_resize
    resize = replace(resize, fast=fast)

    def sample(path: str, fps: float):
        with open_video(path, DecodeConfig(fps=fps, max_frames=10**6)) as reader:
            for sampled in reader.frames(resize=resize):
                for _ in range(sampled.num_samples):
                    yield sampled.rgb

    return sample


def _peer(sample):
    """A peer's sampler, imported when built (like stillcut's)."""
    return lambda: sample


def _pyav(path: str, fps: float):
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        times = iter(_sample_times(float(stream.duration * stream.time_base), fps))
        wanted = next(times, None)
        for frame in container.decode(stream):
            while wanted is not None and frame.time >= wanted - 1e-6:
                yield frame.to_ndarray(format="rgb24", width=TARGET[1], height=TARGET[0])
                wanted = next(times, None)
            if wanted is None:
                break


def _opencv(path: str, fps: float):
    import cv2

    capture = cv2.VideoCapture(path)
    rate = capture.get(cv2.CAP_PROP_FPS)
    count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    wanted = {round(t * rate) for t in _sample_times(count / rate, fps)}
    for index in range(count):
        if not capture.grab():
            break
        if index in wanted:
            ok, bgr = capture.retrieve()
            small = cv2.resize(bgr, (TARGET[1], TARGET[0]), interpolation=cv2.INTER_AREA)
            yield cv2.cvtColor(small, cv2.COLOR_BGR2RGB)
    capture.release()


def _decord2(path: str, fps: float):
    import decord

    reader = decord.VideoReader(path, width=TARGET[1], height=TARGET[0])
    rate = reader.get_avg_fps()
    indices = [round(t * rate) for t in _sample_times(len(reader) / rate, fps)]
    for first in range(0, len(indices), 64):  # bounded batches: memory stays flat
        yield from reader.get_batch(indices[first : first + 64]).asnumpy()


SAMPLERS = {  # mode -> a builder of its sampler
    "stillcut-exact": lambda: _stillcut(False),
    "stillcut-fast": lambda: _stillcut(True),
    "pyav": _peer(_pyav),
    "opencv": _peer(_opencv),
    "decord2": _peer(_decord2),
}


def in_process(args: list[str]) -> dict:
    """Run `args` (a command that prints one JSON object) in a fresh process under this
    script's `--measure`: its answer, with its peak RSS in MB."""
    measure = [sys.executable, __file__, "--measure", *args]
    result = subprocess.run(measure, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else "failed"}
    return json.loads(result.stdout)


def measure(args: list[str]) -> None:
    """Run `args`; print its JSON answer with the peak RSS of that one child."""
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(result.stderr)
    answer = json.loads(result.stdout)
    answer["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps(answer))


def available(mode: str) -> bool:
    module = {"opencv": "cv2", "decord2": "decord"}.get(mode)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def sampling_table(clips: dict[float, Path], fps_list: list[float], rounds: int) -> list[dict]:
    modes = [mode for mode in MODES if available(mode)]
    rows = []
    for minutes, path in clips.items():
        for fps in fps_list:
            runs: dict[str, list[dict]] = {mode: [] for mode in modes}
            for _ in range(rounds):  # interleaved: A, B, C, A, B, C, ...
                for mode in modes:
                    worker = [sys.executable, __file__, "--worker", mode, str(path), str(fps)]
                    runs[mode].append(in_process(worker))
            for mode in modes:
                done = [run for run in runs[mode] if "error" not in run]
                row = {"minutes": minutes, "fps": fps, "mode": mode}
                if not done:
                    rows.append({**row, "error": runs[mode][0]["error"]})
                    continue
                row["seconds"] = statistics.median(run["seconds"] for run in done)
                row["peak_rss_mb"] = statistics.median(run["peak_rss_mb"] for run in done)
                row["frames"] = done[0]["frames"]
                rows.append(row)
    return rows


def inspect_runs(clips: dict[float, Path], plan_clip: Path) -> dict:
    """Peak RSS of `stillcut inspect` at 1 fps per length and EVS setting, whether the plan's
    rate-mode count is what encoding keeps, and the plan's time on `plan_clip`."""
    stillcut = [sys.executable, "-m", "stillcut.service.cli", "inspect"]
    common = ["--fps", "1", "--max-frames", "1000000", "--json"]
    report: dict = {"peak_rss_mb": {}}
    for minutes, path in clips.items():
        for evs in (["--no-evs"], ["--evs-rate", "0.75"]):
            result = in_process([*stillcut, str(path), *common, *evs])
            key = f"{minutes:g}min {' '.join(evs)}"
            report["peak_rss_mb"][key] = result.get("peak_rss_mb", result.get("error"))
            if evs[0] == "--evs-rate" and "plan" in result:
                report.setdefault("plan_equals_kept", {})[f"{minutes:g}min"] = (
                    result["plan"]["tokens_after_evs"] == result["evs"]["tokens_kept"]
                )
    plans = [in_process([*stillcut, str(plan_clip), *common, "--plan"]) for _ in range(3)]
    report["plan_s"] = statistics.median(plan.get("plan_s", float("nan")) for plan in plans)
    return report


def fast_vs_exact(path: Path, seconds: float = 60.0) -> dict:
    """Embedding difference and EVS (rate 0.75) agreement of fast against exact resizing."""
    import torch

    from stillcut.demo import demo_checkpoint
    from stillcut.kernels.evs import EVSConfig, prune
    from stillcut.vision.decode import DecodeConfig
    from stillcut.vision.pipeline import VisionPipeline

    items = {}
    for mode in ("exact", "fast"):
        config = DecodeConfig(fps=1, max_frames=10**6, resize=mode)
        pipeline = VisionPipeline(demo_checkpoint(), decode_config=config)
        items[mode] = pipeline.video(path, evs=None, end=seconds)
    exact, fast = items["exact"].embeds.float(), items["fast"].embeds.float()
    grid = items["exact"].llm_grid
    masks = [prune(e, grid, EVSConfig(mode="rate", rate=0.75)).mask for e in (exact, fast)]
    both = (masks[0] & masks[1]).sum().item()
    return {
        "embedding_rel_diff": ((fast - exact).norm() / exact.norm()).item(),
        "evs_kept_agreement": both / masks[0].sum().item(),
        "cosine_mean": torch.nn.functional.cosine_similarity(exact, fast).mean().item(),
    }


def summarize_table(clips: dict[float, Path], rounds: int, chunk_s: float) -> list[dict]:
    """Per clip length: the medians over `rounds` interleaved fresh-process summaries of the
    chunks, the summary's seconds, chunks per second and peak RSS."""
    stillcut = [sys.executable, "-m", "stillcut.service.cli", "summarize"]
    runs: dict[float, list[dict]] = {minutes: [] for minutes in clips}
    for _ in range(rounds):  # interleaved: A, B, A, B, ...
        for minutes, path in clips.items():
            result = in_process([*stillcut, str(path), "--chunk-s", str(chunk_s), "--json"])
            runs[minutes].append(result)
    rows = []
    for minutes, done in runs.items():
        failed = [run for run in done if "error" in run]
        if failed:
            rows.append({"minutes": minutes, "error": failed[0]["error"]})
            continue
        seconds = statistics.median(run["timings"]["total_s"] for run in done)
        chunks = done[0]["usage"]["num_chunks"]
        rows.append(
            {
                "minutes": minutes,
                "chunks": chunks,
                "summary_s": seconds,
                "chunks_per_s": chunks / seconds,
                "peak_rss_mb": statistics.median(run["peak_rss_mb"] for run in done),
                "rounds": done[0]["num_rounds"],
            }
        )
    return rows


def print_summaries(rows: list[dict]) -> None:
    print(
        f"{'min':>5} {'chunks':>7} {'summary s':>10} {'chunks/s':>9} {'peak MB':>8} {'rounds':>7}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['minutes']:>5g} {row['error']}")
            continue
        print(
            f"{row['minutes']:>5g} {row['chunks']:>7} {row['summary_s']:>10.1f} "
            f"{row['chunks_per_s']:>9.2f} {row['peak_rss_mb']:>8.0f} {row['rounds']:>7}"
        )
    done = [row for row in rows if "error" not in row]
    if len(done) >= 2:
        ratio = done[-1]["peak_rss_mb"] / done[0]["peak_rss_mb"]
        print(f"peak RSS, {done[-1]['minutes']:g} min / {done[0]['minutes']:g} min: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, nargs="+", default=[10, 60])
    parser.add_argument("--base-minutes", type=float, default=10, help="encoded once")
    parser.add_argument("--fps", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plan-minutes", type=float, default=60, help="the plan's clip")
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "PATH", "FPS"))
    parser.add_argument("--measure", nargs=argparse.REMAINDER)
    parser.add_argument("--summarize", action="store_true", help="summaries instead (see above)")
    parser.add_argument("--chunk-s", type=float, default=4.0, help="--summarize's chunks")
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
        return
    if args.worker:
        mode, path, fps = args.worker
        print(json.dumps(run_mode(mode, path, float(fps))))
        return
    started = time.perf_counter()
    clips = {minutes: long_clip(minutes, args.base_minutes) for minutes in args.minutes}
    print(f"clips ready in {time.perf_counter() - started:.0f} s: {sorted(clips)} min", flush=True)
    if args.summarize:
        print_summaries(summarize_table(clips, args.rounds, args.chunk_s))
        return
    rows = sampling_table(clips, args.fps, args.rounds)
    print(f"{'min':>5} {'fps':>5} {'mode':<15} {'seconds':>8} {'peak MB':>8} {'frames':>7}")
    for row in rows:
        if "error" in row:
            print(f"{row['minutes']:>5g} {row['fps']:>5g} {row['mode']:<15} {row['error']}")
            continue
        print(
            f"{row['minutes']:>5g} {row['fps']:>5g} {row['mode']:<15} {row['seconds']:>8.2f} "
            f"{row['peak_rss_mb']:>8.0f} {row['frames']:>7}"
        )
    plan_clip = long_clip(args.plan_minutes, args.base_minutes)
    print(json.dumps({"inspect": inspect_runs(clips, plan_clip)}, indent=2), flush=True)
    first = clips[min(clips)]
    print(json.dumps({"fast_vs_exact": fast_vs_exact(first)}, indent=2))


if __name__ == "__main__":
    main()
