"""Live narration: how fast it keeps up, what each append costs, how far it lags.

`samples/steady_motion.mp4` (320x240, 2 minutes, a ball circling at a steady speed) sampled
at 2 fps, on the random-weight `demo` preset (named explicitly: only shapes matter here),
threshold EVS at the live default, segments capped at 16 tokens; one session, then four at
once on one engine (their decode steps batch together). Frames go in as the WebSocket sends
them (PNG), through the same `Narration`.

  queue, unpaced   frames as fast as they are taken: real-time factor (stream seconds / wall
                   seconds; >= 1.0 keeps up) and mean tokens prefilled per append
  latest, paced    frames at their timestamps: lag from a tubelet's last frame to its
                   segment's first token (p50, p95) and tubelets skipped

    python bench/narrate.py [--seconds 120] [--sessions 1 4]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from stillcut.engine.factory import cached_checkpoint
from stillcut.service.api import VideoLLM
from stillcut.service.async_engine import AsyncEngine
from stillcut.service.narrate_api import file_frames
from stillcut.service.narrate_options import NarrateOptions
from stillcut.service.narration import Narration

CLIP = Path(__file__).resolve().parent.parent / "samples" / "steady_motion.mp4"
FPS = 2.0
PROMPT = "Narrate what happens, one short line at a time."


def png_frames(seconds: float) -> list[tuple[float, bytes]]:
    frames = []
    for timestamp, pixels in file_frames(CLIP, FPS):
        if timestamp >= seconds:
            break
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        frames.append((timestamp, buffer.getvalue()))
    return frames


async def narrate(llm, engine, frames, lag: str, paced: bool, index: int, encoder) -> list[dict]:
    """One session over `frames`; its segment messages."""
    segments = []
    options = NarrateOptions(prompt=PROMPT, fps=FPS, lag=lag, max_tokens_per_segment=16)

    async def emit(message: dict) -> None:
        if message["type"] == "segment":
            segments.append(message)

    loop = asyncio.get_running_loop()
    session = Narration(
        llm.pipeline,
        engine,
        options,
        f"bench-{lag}-{index}",
        emit,
        run_encode=lambda fn: loop.run_in_executor(encoder, fn),
    )
    start = time.monotonic()
    for timestamp, image in frames:
        if paced:
            await asyncio.sleep(max(0.0, start + timestamp - time.monotonic()))
        await session.add_frame(timestamp, image)
    await session.drain()
    await session.close()
    return segments


async def run_mode(llm, frames, num_sessions: int, lag: str, paced: bool) -> tuple:
    engine = AsyncEngine(llm.engine)
    with ThreadPoolExecutor(1) as encoder:  # one vision tower: one encode at a time
        try:
            start = time.monotonic()
            runs = [
                narrate(llm, engine, frames, lag, paced, k, encoder) for k in range(num_sessions)
            ]
            sessions = await asyncio.gather(*runs)
            return sessions, time.monotonic() - start
        finally:
            engine.shutdown()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="stream length used")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    llm = VideoLLM(cached_checkpoint("random-demo", seed=0))
    frames = png_frames(args.seconds)
    stream_s = frames[-1][0] + 1 / FPS
    print(f"{CLIP.name}: {len(frames)} frames at {FPS:g} fps ({stream_s:.0f} s), demo preset")
    print(
        f"{'sessions':>8} {'mode':>14} {'RTF':>6} {'prefill/append':>15} {'lag p50':>8} "
        f"{'lag p95':>8} {'skipped':>8}"
    )
    for num_sessions in args.sessions:
        sessions, wall = asyncio.run(run_mode(llm, frames, num_sessions, "queue", paced=False))
        appends = [s["prefill_tokens"] for segments in sessions for s in segments[1:]]
        print(
            f"{num_sessions:>8} {'queue unpaced':>14} {stream_s / wall:>6.2f} "
            f"{statistics.mean(appends):>15.1f}"
        )
        sessions, _ = asyncio.run(run_mode(llm, frames, num_sessions, "latest", paced=True))
        lags = [s["lag_s"] for segments in sessions for s in segments]
        skipped = sum(s["skipped"] for segments in sessions for s in segments)
        print(
            f"{num_sessions:>8} {'latest paced':>14} {'':>6} {'':>15} "
            f"{percentile(lags, 0.5):>7.2f}s {percentile(lags, 0.95):>7.2f}s {skipped:>8}"
        )


if __name__ == "__main__":
    main()
