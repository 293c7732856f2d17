"""Service throughput under load vs the same work offline, in one run.

The same N describe requests (sample clips, each at its own sampling rate so every request
decodes and encodes afresh) run twice on fresh copies of one model, caches cold:

- offline: `VideoLLM.encode` over all clips, then one batched `engine.generate`, the engine
  path `describe_video` takes, decode and encode included;
- service: a uvicorn server in this process, loaded by a second process on loopback with N
  concurrent clients, each uploading its clip to `POST /v1/videos/describe`.

The model defaults to the random-demo preset (110M parameters), the shape the speed checks
measure. It prints requests/s for both, p50/p99 latency of the service, their ratio (the target is
>= 80 %), and the CPU time the load generator used: it shares the machine's cores with the
server, so its share is a cost the offline run does not pay.

    python bench/serve.py [--model PATH] [--clients 16] [--max-tokens 32]
    python bench/serve.py --hostile [--model PATH] [--prefill-chunk 512] [--long-tokens 8000]

`--hostile` measures something else: the worst `/health` latency under a JSON bomb, key-less
8 MB WebSocket starts and a long prompt, and a short request's time to first token beside that
prompt against its bound (`serve_hostile`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
CLIPS = ("moving_object.mp4", "pan.mp4", "scene_cut.mp4", "motion_mask.mp4")
PROMPT = "Describe this video."


def workload(num_requests: int) -> list[tuple[Path, float]]:
    """(clip, fps) per request: the clips in turn, each round at another rate."""
    return [
        (SAMPLES / CLIPS[i % len(CLIPS)], 2.0 + 0.25 * (i // len(CLIPS)))
        for i in range(num_requests)
    ]


def run_offline(model: str, work, max_tokens: int) -> float:
    """Seconds for the whole workload through encode + one batched generate."""
    from stillcut.engine.request import SamplingParams
    from stillcut.service.api import DEFAULT_EVS, VideoLLM
    from stillcut.vision.pipeline import VideoInput

    llm = VideoLLM(model)
    llm.describe(warm_up_clip(), max_tokens=2)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    specs = [VideoInput(path, evs=DEFAULT_EVS, fps=fps) for path, fps in work]
    items = llm.encode(specs)
    prompts = [llm.processor.build_text(PROMPT, [item]) for item in items]
    llm.engine.generate(prompts, params)
    return time.perf_counter() - started


def warm_up_clip() -> bytes:
    """A tiny clip for one untimed request, so timed ones pay no first-call costs."""
    import io

    from stillcut.vision.synthetic import moving_texture, write_video

    buffer = io.BytesIO()
    write_video(buffer, moving_texture(4, 112, 112, seed=99))
    return buffer.getvalue()


def run_service(model: str, work, max_tokens: int) -> dict:
    """The load generator's report on the workload sent through the server."""
    import httpx

    from stillcut.service.api import VideoLLM
    from stillcut.service.config import ServerConfig
    from stillcut.service.server import BackgroundServer

    server = BackgroundServer(VideoLLM(model), ServerConfig(max_queue=len(work)))
    try:
        files = {"file": ("warm.mp4", warm_up_clip(), "video/mp4")}
        warm = httpx.post(f"{server.url}/v1/videos/describe", files=files, timeout=600)
        warm.raise_for_status()
        command = [sys.executable, __file__, "--load", server.url, "--max-tokens", str(max_tokens)]
        command += ["--clients", str(len(work))]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    finally:
        server.stop()
    return json.loads(done.stdout)


def load(url: str, work, max_tokens: int) -> dict:
    """The load generator: one concurrent client per request; latencies and own CPU time."""
    import httpx

    async def one(client, path: Path, fps: float) -> float:
        started = time.perf_counter()
        response = await client.post(
            "/v1/videos/describe",
            files={"file": (path.name, path.read_bytes(), "video/mp4")},
            data={"prompt": PROMPT, "max_tokens": max_tokens, "fps": fps},
        )
        response.raise_for_status()
        return time.perf_counter() - started

    async def run() -> list[float]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            return await asyncio.gather(*(one(client, path, fps) for path, fps in work))

    cpu_started, started = time.process_time(), time.perf_counter()
    latencies = asyncio.run(run())
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total_cpu = usage.ru_utime + usage.ru_stime
    return {"wall_s": wall, "latencies": latencies, "cpu_s": cpu, "total_cpu_s": total_cpu}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint folder or hub id (default: random-demo)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests (16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (32)")
    parser.add_argument("--load", metavar="URL", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--hostile", action="store_true", help="hostile load (see above)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="--hostile: chunk (512)")
    parser.add_argument("--long-tokens", type=int, default=8000, help="--hostile: long prompt")
    parser.add_argument("--rounds", type=int, default=2, help="--hostile: rounds per mode (2)")
    args = parser.parse_args()
    work = workload(args.clients)
    if args.load:
        print(json.dumps(load(args.load, work, args.max_tokens)))
        return
    from stillcut.engine.factory import random_demo_checkpoint

    model = args.model or str(random_demo_checkpoint())  # the 110M shape, not the tiny demo
    if args.hostile:
        from serve_hostile import run

        run(model, args.prefill_chunk, args.long_tokens, args.rounds)
        return
    offline_s = run_offline(model, work, args.max_tokens)
    report = run_service(model, work, args.max_tokens)
    service_s, latencies = report["wall_s"], report["latencies"]
    n = len(work)
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    rows = [
        ("offline (encode + batch)", offline_s, "-", "-"),
        ("service (HTTP, loopback)", service_s, f"{p50:.2f}", f"{p99:.2f}"),
    ]
    print(f"{n} requests, {args.max_tokens} tokens each, clips {', '.join(CLIPS)}")
    print(f"{'':<26}{'wall s':>8}{'req/s':>8}{'p50 s':>8}{'p99 s':>8}")
    for name, wall, p50_text, p99_text in rows:
        print(f"{name:<26}{wall:>8.2f}{n / wall:>8.2f}{p50_text:>8}{p99_text:>8}")
    print(f"service keeps {offline_s / service_s:.0%} of offline throughput")
    cpu = report["cpu_s"]
    print(
        f"load generator: {cpu:.2f} s CPU in the timed window ({cpu / service_s:.0%} of one "
        f"core), {report['total_cpu_s']:.2f} s in all (its startup included)"
    )


if __name__ == "__main__":
    main()
