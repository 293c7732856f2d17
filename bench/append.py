"""What one append to a live request costs as the request grows: a short and a long session.

Two held prefixes on one engine (the tiny random Qwen2.5-VL checkpoint), each one logical video
of tubelets: `short` holds --short tubelets, `long` --long. Each round appends one more tubelet
to each (interleaved: short, long, short, long ...) and steps until it is prefilled. The time
is split into the model's forward and the rest (scheduler, KV bookkeeping, runner rows,
positions, inputs): the rest is what an append costs beyond its own compute, and must not grow
with the session. Medians over the rounds; the ratio long / short is the result (1.0 = flat).

    python bench/append.py [--short 16] [--long 512] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.vision.pipeline import VisionPipeline


class ForwardTimer:
    """Wraps the model's forward and adds up the seconds spent in it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._forward = model.forward
        model.forward = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def tubelet(base, index: int):
    """Tubelet `index` of one logical video: t = index in a grid that grows with the stream."""
    return replace(
        base,
        identifier=f"bench-{index}",
        coords=base.coords + torch.tensor([index, 0, 0]),
        grid_thw=(index + 1, *base.grid_thw[1:]),
    )


def timed_append(engine: LLMEngine, timer: ForwardTimer, request_id: str, item) -> tuple:
    """Append one tubelet and step until it is prefilled: (total, outside the forward) s."""
    pads = [engine.processor.special.video_token_id] * item.num_tokens
    forward_before, start = timer.seconds, time.perf_counter()
    engine.append_input(request_id, pads, [item])
    while engine.has_unfinished_requests():
        engine.step()
    total = time.perf_counter() - start
    return total, total - (timer.seconds - forward_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", type=int, default=16, help="tubelets in the short session")
    parser.add_argument("--long", type=int, default=512, help="tubelets in the long session")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = cached_checkpoint("tiny", seed=0)
    frames = np.random.default_rng(0).integers(0, 256, (2, 56, 84, 3), dtype=np.uint8)
    base = VisionPipeline(path).video(frames, frames_fps=2.0)
    num_tokens = base.num_tokens * (args.long + args.rounds + 1) + 64
    engine = LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(
                max_num_batched_tokens=8192,
                max_model_len=num_tokens,
                max_visual_tokens_per_request=num_tokens,
            ),
            cache=CacheConfig(block_size=16, num_blocks=2 * num_tokens // 16 + 8, held_share=1.0),
        ),
    )
    timer = ForwardTimer(engine.model)
    sessions = {}
    for name, length in (("short", args.short), ("long", args.long)):
        items = [tubelet(base, k) for k in range(length)]
        sessions[name] = engine.add_request(engine.processor.vision_prefix(items), hold=True)
        while engine.has_unfinished_requests():
            engine.step()
    lengths = {"short": args.short, "long": args.long}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sessions}
    for _ in range(args.rounds):
        for name, request_id in sessions.items():
            times[name].append(
                timed_append(engine, timer, request_id, tubelet(base, lengths[name]))
            )
            lengths[name] += 1
    print(f"one tubelet of {base.num_tokens} tokens appended per round, {args.rounds} rounds")
    print(f"{'session':>8} {'tubelets':>9} {'total ms':>9} {'host ms':>8}")
    medians = {}
    for name in sessions:
        total = statistics.median(t for t, _ in times[name]) * 1e3
        host = statistics.median(h for _, h in times[name]) * 1e3
        medians[name] = (total, host)
        print(f"{name:>8} {lengths[name]:>9} {total:>9.2f} {host:>8.2f}")
    (short_total, short_host), (long_total, long_host) = medians["short"], medians["long"]
    print(
        f"long / short: total {long_total / short_total:.2f}x, host {long_host / short_host:.2f}x"
    )


if __name__ == "__main__":
    main()
