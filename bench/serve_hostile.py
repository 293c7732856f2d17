"""`bench/serve.py --hostile`: the service's responsiveness under hostile load.

A `stillcut serve --api-key` process is loaded, on loopback, with a 40 MB JSON bomb (a flat list
of 20 M numbers, under the body limit), eight key-less WebSockets each sending an 8 MB start,
and a prompt of `--long-tokens` tokens; a short chat is sent while the long prompt prefills.
Meanwhile `/health` is asked every 50 ms. Reported: the worst `/health` latency (target
<= 0.5 s) and the short request's time to first token against its bound, two of the long
prompt's chunk-times plus its own prefill (both measured alone on the same server first).
Rounds alternate `--max-prefill-chunk` on and 0 (the whole step budget), A B A B; medians.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
from websockets.asyncio.client import connect

from stillcut.service.server import wait_until_serving

KEY = "sk-bench"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEALTH_TARGET_S = 0.5
BOMB_VALUES = 20_000_000
NUM_BIG_STARTS, BIG_START_BYTES = 8, 8_000_000
SHORT_PROMPT = "Say hi."  # ~22 tokens once templated (the prefix cache keeps its template)


def run(model: str, chunk: int, long_tokens: int, rounds: int) -> None:
    """Print the table (see the module docstring)."""
    results: dict[int, list[dict]] = {chunk: [], 0: []}
    for _ in range(rounds):
        for mode in (chunk, 0):
            results[mode].append(_round(model, mode, long_tokens))
    print(f"hostile load, {long_tokens}-token prompt beside a short one; medians of {rounds}")
    header = f"{'prefill chunk':<16}{'worst /health s':>16}{'short TTFT s':>14}{'bound s':>9}"
    print(header + f"{'within':>8}")
    for mode, rows in results.items():
        health = statistics.median(r["worst_health_s"] for r in rows)
        ttft = statistics.median(r["short_ttft_s"] for r in rows)
        bound = statistics.median(r["bound_s"] for r in rows)
        name = f"{mode} tokens" if mode else "whole budget"
        print(f"{name:<16}{health:>16.3f}{ttft:>14.3f}{bound:>9.3f}{str(ttft <= bound):>8}")
    print(f"/health target <= {HEALTH_TARGET_S} s")


def _round(model: str, chunk: int, long_tokens: int) -> dict:
    port = _free_port()
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "stillcut.service.cli", "serve", "--model", model),
            *("--port", str(port), "--api-key", KEY, "--max-prefill-chunk", str(chunk)),
            *("--max-model-len", str(long_tokens + 1024), "--log-level", "warning"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, server, timeout_s=300)
        return asyncio.run(_measure(url, chunk or 2048, long_tokens))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


async def _measure(url: str, chunk: int, long_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=600) as client:
        await _ttft(client, SHORT_PROMPT)  # warm-up: pools, the native step
        own_prefill_s = await _ttft(client, SHORT_PROMPT)
        chunk_s = await _ttft(client, _words(min(chunk, long_tokens)))
        per_token_s = await _ttft(client, _words(512)) / 512  # the same in both modes
        stop = asyncio.Event()
        health = asyncio.ensure_future(_worst_health(client, stop))
        # the attack runs in a process of its own: building and masking its messages here
        # would delay this loop's own timings
        attack = await asyncio.create_subprocess_exec(sys.executable, __file__, url)
        long_prompt = asyncio.ensure_future(_ttft(client, _words(long_tokens)))
        await asyncio.sleep(0.25 * long_tokens * per_token_s)  # a quarter into its prefill
        short_ttft_s = await _ttft(client, SHORT_PROMPT)
        await long_prompt
        if await attack.wait():
            raise RuntimeError(f"the attack failed ({attack.returncode})")
        stop.set()
        return {
            "worst_health_s": await health,
            "short_ttft_s": short_ttft_s,
            "bound_s": 2 * chunk_s + own_prefill_s,
        }


async def _ttft(client: httpx.AsyncClient, text: str) -> float:
    """Seconds to the first streamed chunk with text of a 2-token chat answer."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "stream": True}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                return time.perf_counter() - started
    raise RuntimeError("the answer had no text")


async def _worst_health(client: httpx.AsyncClient, stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        started = time.perf_counter()
        (await client.get("/health")).raise_for_status()
        worst = max(worst, time.perf_counter() - started)
        await asyncio.sleep(0.05)
    return worst


async def _attack(url: str) -> None:
    """The hostile part of the load: the key-less 8 MB starts and the bomb, at once."""
    ws_url = url.replace("http://", "ws://") + "/v1/stream"
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=600) as client:
        starts = [_big_start(ws_url) for _ in range(NUM_BIG_STARTS)]
        await asyncio.gather(*starts, _bomb(client))


async def _big_start(url: str) -> None:
    async with connect(url, proxy=None, max_size=None, open_timeout=60) as ws:
        await ws.send(json.dumps({"type": "start", "pad": "x" * BIG_START_BYTES}))
        await ws.recv()


async def _bomb(client: httpx.AsyncClient) -> None:
    body = b'{"messages": [], "junk": [' + b"0," * BOMB_VALUES + b"0]}"
    headers = {"content-type": "application/json"}
    response = await client.post("/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 400, response.text


def _words(num_tokens: int) -> str:
    """A prompt of about `num_tokens` tokens that no earlier one shares a prefix with (the
    prefix cache would answer it otherwise)."""
    return f"{time.perf_counter_ns()} " + "hello " * num_tokens


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":  # the attacking process: URL
    asyncio.run(_attack(sys.argv[1]))
