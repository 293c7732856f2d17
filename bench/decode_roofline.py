"""Decode step time against the memory-bandwidth floor.

A batch-1 decode step of a small model is bound by reading its weights: every step reads each
layer's weights and the LM head once (the embedding table is only gathered, a few rows). The
floor is those bytes divided by the read bandwidth measured in this run, with the same thread
count (summing a buffer as large as the weights). The table shows the engine's full decode step
(schedule, inputs, forward, logits, sampling) at batch 1 and 8 next to that floor, measured in
back-to-back pairs (the ratio is the median of the pairs' ratios); the target at batch 1, for a
model of at least 100M parameters, is a ratio of 1.25 or less. On CPU a model runs its decode
steps as one native call (`kernels/cpu_decode`) where the kernel builds; the last row runs the
same steps through the model's torch ops, for comparison.

    python bench/decode_roofline.py [--model PATH] [--threads 1] [--rounds 25]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import demo_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams

TARGET = 1.25


def weight_bytes_per_step(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes read per decode step, parameter count). An untied embedding table is only
    gathered, so it is left out; a tied model reads its head, which doubles as the table."""
    total_params = sum(p.numel() for p in model.parameters())
    read = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "embed_tokens", None) is not None:
        read -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return read, total_params


def read_seconds(buffer: torch.Tensor) -> float:
    """Seconds to read `buffer` once (a sum: one streaming pass)."""
    start = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - start


class PartTimer:
    """Seconds spent in the model's decoder layers (`forward`) and head (`compute_logits`),
    recorded by wrapping the two methods of one model instance."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.parts: dict[str, list[float]] = {"forward": [], "compute_logits": []}
        for name, spent in self.parts.items():
            setattr(model, name, self._timed(getattr(model, name), spent))

    def stop(self) -> dict[str, float]:
        """Unwrap the methods; the median seconds of each part."""
        for name in self.parts:
            delattr(self.model, name)  # back to the class's method
        return {name: statistics.median(spent) for name, spent in self.parts.items()}

    @staticmethod
    def _timed(method, spent: list[float]):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            spent.append(time.perf_counter() - start)
            return result

        return timed


def paired_rounds(engine: LLMEngine, batch: int, rounds: int, num_bytes: int) -> list[tuple]:
    """`rounds` pairs of (median seconds of 3 engine steps while `batch` requests all decode,
    seconds to read `num_bytes`) measured back to back, so that both see the same machine: on a
    shared host the read bandwidth drifts by tens of percent within a minute."""
    buffer = torch.ones(num_bytes // 4)
    prompt = engine.processor.build_text("Tell me about the sea.")
    params = SamplingParams(max_tokens=3 * rounds + 16, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    while any(
        engine.scheduler.requests[i].num_computed_tokens < len(prompt.token_ids) for i in ids
    ):
        engine.step()  # prefill (and the first decodes)
    for _ in range(5):
        engine.step()  # warm up
    pairs = []
    for _ in range(rounds):
        steps = []
        for _ in range(3):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        pairs.append((statistics.median(steps), read_seconds(buffer)))
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the demo checkpoint, 110M params)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=25, help="paired step/floor rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512),
        cache=CacheConfig(num_blocks=512),
    )
    engine = LLMEngine(args.model or demo_checkpoint(), config)
    num_bytes, num_params = weight_bytes_per_step(engine.model)
    head_bytes = engine.model.lm_head.numel() * engine.model.lm_head.element_size()
    native = engine.model.cpu_decoder
    path = "native step" if native is not None else "torch ops"
    runs = [(1, path), (8, path)] + ([(1, "torch ops")] if native is not None else [])
    rows, parts = [], {}
    for batch, how in runs:
        engine.model.cpu_decoder = native if how == "native step" else None
        timer = PartTimer(engine.model) if not rows else None
        pairs = paired_rounds(engine, batch, args.rounds, num_bytes)
        if timer is not None:
            parts = timer.stop()
        step = statistics.median(p[0] for p in pairs)
        floor = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        rows.append((batch, how, step, floor, ratio, num_bytes / floor))
    engine.model.cpu_decoder = native
    print(
        f"model: {num_params / 1e6:.1f}M parameters, {num_bytes / 1e6:.0f} MB read per step, "
        f"{args.threads} thread(s), {args.rounds} paired rounds"
    )
    print(
        f"{'batch':>6}  {'decode':<12}{'step ms':>9}{'floor ms':>10}{'ratio':>8}{'read GB/s':>11}"
    )
    for batch, how, step, floor, ratio, bandwidth in rows:
        print(
            f"{batch:>6}  {how:<12}{step * 1e3:>9.2f}{floor * 1e3:>10.2f}{ratio:>8.2f}"
            f"{bandwidth / 1e9:>11.1f}"
        )
    step, bandwidth = rows[0][2], rows[0][5]
    layers, head = parts["forward"], parts["compute_logits"]
    print(
        f"batch 1, where a step goes: layers {layers * 1e3:.2f} ms (their weights' floor "
        f"{(num_bytes - head_bytes) / bandwidth * 1e3:.2f}), head {head * 1e3:.2f} ms (floor "
        f"{head_bytes / bandwidth * 1e3:.2f}), outside the model {(step - layers - head) * 1e3:.2f}"
        " ms"
    )
    ratio = rows[0][4]
    verdict = "met" if ratio <= TARGET else "MISSED"
    print(
        f"batch 1: {ratio:.2f}x the floor, median of paired rounds (target <= {TARGET}: {verdict})"
    )


if __name__ == "__main__":
    main()
