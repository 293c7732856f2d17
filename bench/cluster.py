"""Replicas on Ray Serve, in one run: what the ingress costs, and what media affinity buys.

(a) Overhead: 16 concurrent chat requests (the sample clips, each request at a sampling rate
    of its own, so every one decodes and encodes afresh) against plain `stillcut serve` and
    against one replica behind Ray's proxy and the ingress, each with 2 threads, both built
    from the same command-line flags. Runs alternate A B B A ..., each at rates no earlier run
    used; requests/s per run, medians, and their ratio (target >= 0.85).
(b) Routing: 2 replicas of 1 thread each; 16 clients, 2 per video over 8 videos; each client
    asks a question, waits for the answer, then asks a second (streamed, max_tokens 32).
    Media affinity against Ray Serve's default router (power of two choices), each run on a
    freshly started cluster (cold caches), both modes on one round's videos, the order
    alternating; each round has videos of its own, so the medians cover several splits of 8
    keys over 2 replicas. The share of the second questions' prompt tokens served from the
    prefix cache, and their mean time to first token at the client, medians of rounds
    (target: affinity's <= 0.5x the default's).

The default model is the demo checkpoint (~110M parameters: its vision tower costs about a
second per clip here). The machine's load average is printed: benchmarks on a shared
machine are noisy, which the alternation and the medians are there to absorb.

    python bench/cluster.py [--model PATH] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
CLIPS = ("moving_object.mp4", "pan.mp4", "scene_cut.mp4", "motion_mask.mp4")
NUM_CLIENTS = 16
MAX_TOKENS = 32
QUESTIONS = ("What moves in this video?", "What colour is the background?")


def chat_body(video: bytes, question: str, **extra) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": question}]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def overhead_bodies(run: int) -> list[dict]:
    """(a)'s requests for one run: the clips in turn, each at a sampling rate no other request
    uses (so no cache helps), all close to 2 fps (so every run costs the same)."""
    videos = [(SAMPLES / name).read_bytes() for name in CLIPS]
    rates = [2.0 + 0.001 * (NUM_CLIENTS * run + i) for i in range(NUM_CLIENTS)]
    return [chat_body(videos[i % len(CLIPS)], QUESTIONS[0], fps=rates[i]) for i in range(16)]


async def throughput(url: str, bodies: list[dict]) -> float:
    """Requests/s for `bodies` sent at once."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        started = time.perf_counter()
        responses = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body) for body in bodies)
        )
        elapsed = time.perf_counter() - started
    for response in responses:
        response.raise_for_status()
    return len(bodies) / elapsed


def routing_videos(round_index: int) -> list[bytes]:
    """(b)'s 8 videos for one round (both modes get the same bytes): 6 s at 336x252, 12
    frames sampled from each."""
    from stillcut.vision.synthetic import moving_texture, write_video

    videos = []
    for seed in range(8):
        buffer = io.BytesIO()
        frames = moving_texture(24, 336, 252, seed=100 + 8 * round_index + seed)
        write_video(buffer, frames, time_base=Fraction(1, 4))
        videos.append(buffer.getvalue())
    return videos


def slot_split(videos: list[bytes]) -> str:
    """How many of the videos prefer each replica's slot, as the affinity router ranks them
    (8 keys over 2 replicas split unevenly more often than not)."""
    from stillcut.service.cluster.affinity import media_key
    from stillcut.service.cluster.router import rendezvous_order

    slots = {"rank-0": "rank-0", "rank-1": "rank-1"}
    preferred = [rendezvous_order(media_key(video), slots)[0] for video in videos]
    return "/".join(str(preferred.count(slot)) for slot in slots)


async def streamed(client, body: dict) -> tuple[float, int, int]:
    """(seconds to the first event, prompt tokens, cached tokens) of one streamed answer."""
    started = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ttft = ttft or time.perf_counter() - started
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
    return ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def second_questions(url: str, videos: list[bytes]) -> dict:
    """(b)'s clients; the second questions' mean TTFT and cached share."""
    import httpx

    async def client_asks(client, video: bytes):
        await streamed(client, chat_body(video, QUESTIONS[0]))
        return await streamed(client, chat_body(video, QUESTIONS[1]))

    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        seconds = await asyncio.gather(
            *(client_asks(client, videos[i // 2]) for i in range(NUM_CLIENTS))
        )
    return {
        "ttft_s": statistics.fmean(ttft for ttft, _, _ in seconds),
        "cached": sum(cached for *_, cached in seconds) / sum(p for _, p, _ in seconds),
    }


@contextmanager
def plain_server(model: str) -> Iterator[str]:
    """`stillcut serve` in its own process; its URL once healthy."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = shutil.which("stillcut", path=str(Path(sys.executable).parent))
    flags = ["serve", "--model", model, "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen([command, *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "no plain server"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def cluster(model: str, *, replicas: int, cpus: float, affinity: bool = True):
    """The cluster `stillcut serve --replicas` would start, on a free local port."""
    from stillcut.service import cli, cli_serve
    from stillcut.service.cluster.launch import running_cluster

    argv = ["serve", "--model", model, "--log-level", "warning", "--replicas", str(replicas)]
    argv += ["--num-cpus-per-replica", str(cpus)]
    spec, config = cli_serve.cluster_settings(cli.build_parser().parse_args(argv))
    return running_cluster(spec, dataclasses.replace(config, affinity=affinity))


def measure_overhead(model: str, rounds: int) -> dict[str, list[float]]:
    warm = [chat_body((SAMPLES / CLIPS[0]).read_bytes(), QUESTIONS[0], max_tokens=2, fps=0.5)]
    runs: dict[str, list[float]] = {"plain": [], "ray": []}
    with plain_server(model) as plain_url, cluster(model, replicas=1, cpus=2) as ray_url:
        urls = {"plain": plain_url, "ray": ray_url}
        for url in urls.values():
            asyncio.run(throughput(url, warm))  # first-call costs, untimed
        order = [("plain", "ray") if k % 2 == 0 else ("ray", "plain") for k in range(rounds)]
        for k, mode in enumerate(mode for pair in order for mode in pair):
            runs[mode].append(asyncio.run(throughput(urls[mode], overhead_bodies(k))))
            print(f"  (a) {mode:5} {runs[mode][-1]:.3f} req/s", file=sys.stderr, flush=True)
    return runs


def measure_routing(model: str, rounds: int) -> tuple[dict[str, list[dict]], list[str]]:
    """Each mode's results per round, and each round's split of its videos over the slots."""
    runs: dict[str, list[dict]] = {"affinity": [], "default": []}
    splits = []
    for k in range(rounds):
        videos = routing_videos(k)
        splits.append(slot_split(videos))
        for mode in ("affinity", "default") if k % 2 == 0 else ("default", "affinity"):
            with cluster(model, replicas=2, cpus=1, affinity=mode == "affinity") as url:
                runs[mode].append(asyncio.run(second_questions(url, videos)))
            result = runs[mode][-1]
            print(
                f"  (b) round {k} ({splits[-1]}) {mode:8} ttft {result['ttft_s']:.2f} s, "
                f"cached {result['cached']:.0%}",
                file=sys.stderr,
                flush=True,
            )
    return runs, splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint folder (default: the demo checkpoint)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode (default 3)")
    args = parser.parse_args()
    from stillcut.demo import demo_checkpoint

    model = args.model or str(demo_checkpoint())
    load_before = os.getloadavg()
    started = time.perf_counter()
    overhead = measure_overhead(model, args.rounds)
    routing, splits = measure_routing(model, args.rounds)
    plain, ray = (statistics.median(overhead[mode]) for mode in ("plain", "ray"))
    ttft = {mode: statistics.median(r["ttft_s"] for r in runs) for mode, runs in routing.items()}
    cached = {mode: statistics.median(r["cached"] for r in runs) for mode, runs in routing.items()}
    print(f"model {Path(model).name}; {args.rounds} runs per mode, medians")
    print("| (a) 16 clients, 2 threads | requests/s |")
    print("|---|---|")
    print(f"| plain `stillcut serve` | {plain:.3f} |")
    print(f"| 1 replica through Ray Serve | {ray:.3f} |")
    print(f"| ratio (target >= 0.85) | **{ray / plain:.2f}** |")
    print(f"each round's ratio: {_ratios(overhead['ray'], overhead['plain'])}")
    print()
    print("| (b) 2 replicas x 1 thread, 16 clients, 8 videos | second-question TTFT | cached |")
    print("|---|---|---|")
    for mode, label in (("affinity", "media affinity"), ("default", "Ray's default router")):
        print(f"| {label} | {ttft[mode]:.2f} s | {cached[mode]:.0%} |")
    print(f"| TTFT ratio (target <= 0.5) | **{ttft['affinity'] / ttft['default']:.2f}** | |")
    affinity_ttft, default_ttft = (
        [r["ttft_s"] for r in routing[m]] for m in ("affinity", "default")
    )
    print(f"each round's TTFT ratio: {_ratios(affinity_ttft, default_ttft)}")
    print(f"videos per replica slot, by round: {', '.join(splits)}")
    load_after = os.getloadavg()
    print()
    print(
        f"load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/"
        f"{load_before[2]:.1f}, after {load_after[0]:.1f}/{load_after[1]:.1f}/"
        f"{load_after[2]:.1f}; {time.perf_counter() - started:.0f} s"
    )


def _ratios(numerators: list[float], denominators: list[float]) -> str:
    """Each round's ratio, the two modes of a round having run one after the other."""
    return ", ".join(f"{a / b:.2f}" for a, b in zip(numerators, denominators, strict=True))


if __name__ == "__main__":
    main()
