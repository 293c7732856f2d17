"""Sampler speed per path: what one decode step's sampling costs at a real vocabulary size.

Random fp32 logits `[batch, vocab]` (Qwen2.5's 151,936 by default) go through `Sampler` under
one parameter mix per row of the table. "build" is `build_sampling_batch` from the rows'
parameters and penalty `TokenCounts` (the runner pays it when the rows that sample change, and
every step while one of them is penalized; the counts themselves grow one token a step); "sample"
is the sampler call. Timed runs alternate between the mixes so machine noise hits all alike; the
table shows medians.

    python bench/sampler.py [--batch 32] [--vocab 151936] [--runs 10] [--device cpu|cuda]
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from stillcut.engine.request import SamplingParams
from stillcut.engine.sampler import Sampler, TokenCounts, build_sampling_batch

PROMPT_LEN, OUTPUT_LEN = 2048, 256

MIXES: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda row: SamplingParams(),
    "temperature": lambda row: SamplingParams(temperature=0.8),
    "seeded temperature": lambda row: SamplingParams(temperature=0.8, seed=row),
    "top-k 50": lambda row: SamplingParams(temperature=0.8, top_k=50),
    "top-p 0.9": lambda row: SamplingParams(temperature=0.8, top_p=0.9),
    "top-k + top-p + min-p": lambda row: SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05
    ),
    "penalties (greedy)": lambda row: SamplingParams(
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "mixed + logprobs 5": lambda row: [
        SamplingParams(logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.8, seed=row),
        SamplingParams(temperature=1.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.6, top_k=20, min_p=0.1),
    ][row % 4],
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_mix(name: str, batch: int, vocab: int, device: torch.device) -> tuple[float, float]:
    """One timed step of a mix: (build seconds, sample seconds)."""
    params = [MIXES[name](row) for row in range(batch)]
    generators = [
        None if p.seed is None else torch.Generator(device).manual_seed(p.seed) for p in params
    ]
    counts = [
        TokenCounts(
            range(row, row + PROMPT_LEN),
            [(row * 7 + i) % vocab for i in range(OUTPUT_LEN)],
            vocab,
            device,
        )
        if TokenCounts.needed(p)
        else None
        for row, p in enumerate(params)
    ]
    logits = torch.randn(batch, vocab, device=device)
    sync(device)
    start = time.perf_counter()
    sampling_batch = build_sampling_batch(params, counts, generators, device)
    sync(device)
    built = time.perf_counter()
    Sampler()(logits, sampling_batch)
    sync(device)
    return built - start, time.perf_counter() - built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in MIXES}
    for name in MIXES:  # warm-up
        time_mix(name, args.batch, args.vocab, device)
    for _ in range(args.runs):
        for name in MIXES:
            times[name].append(time_mix(name, args.batch, args.vocab, device))
    print(f"batch {args.batch}, vocab {args.vocab}, {args.device}, median of {args.runs} (ms)")
    print(f"{'mix':<24}{'build':>10}{'sample':>10}")
    for name, runs in times.items():
        build = statistics.median(b for b, _ in runs) * 1e3
        sample = statistics.median(s for _, s in runs) * 1e3
        print(f"{name:<24}{build:>10.2f}{sample:>10.2f}")


if __name__ == "__main__":
    main()
