"""Speculative decoding: tokens/s and acceptance against decoding without it, and the verify
step against its floor.

Random weights say nothing about real acceptance, so the verify machinery is timed with a
bench-only `replay` proposer: it proposes the request's true greedy continuation (from a run
of the same prompts without speculation) with each token replaced by a wrong one with
probability 1 - alpha, at no proposing cost. Modes run interleaved (every mode once per
round, the order rotating), each a `generate` of `--tokens` greedy tokens per request at
batch 1, 4 and 16 beside a run without speculation at the same batch size (before it in even
rounds, after it in odd ones); ratios are medians of those pairs' ratios. Replay runs
with K pinned to 4 and with dynamic K (the start-up calibration's step costs, the step's
requests' acceptance). Then the real proposers on repeated
questions about the same sample videos: ngram, suffix (one cache salt, so a repeated question
finds the earlier answer) and a draft about 10x smaller than the target (same tokenizer and
preprocessing; its own tower encodes the videos too; a text question is asked beside the video
ones), with their acceptance and the draft's cost per step. Last, the batch-1 verify step of 5
tokens (forward and logits) beside its floor, max(weight bytes / read bandwidth, FLOPs / the
fp32 rate of a 2048^3 matmul), all three measured interleaved in this run.

Targets: verify step <= 1.7x its floor; batch 1, alpha 0.7, K = 4: >= 1.8x the tokens/s of no
speculation; with dynamic K no batch size and no alpha below 0.95x of no speculation.

    python bench/spec_decode.py [--rounds 3] [--tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.matmul import head_shape
from stillcut.engine.request import SamplingParams
from stillcut.engine.spec_decode.calibration import measure_step_costs, time_verify_step
from stillcut.engine.spec_decode.draft import DraftProposer
from stillcut.engine.spec_decode.ngram import NgramProposer
from stillcut.engine.spec_decode.policy import SpeculationPolicy
from stillcut.engine.spec_decode.speculator import Speculator
from stillcut.engine.spec_decode.suffix import SuffixProposer

ALPHAS = (0.9, 0.7, 0.5, 0.0)
BATCHES = (1, 4, 16)
K = 4
SAMPLES = Path(__file__).resolve().parent.parent / "samples"
QUESTIONS = ("Tell me about the sea.", "Describe a day at the market.", "Why is the sky blue?")
DRAFT_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128}  # fmt: skip
PINNED = SpeculativeConfig(num_speculative_tokens=K, dynamic=False)
DYNAMIC = SpeculativeConfig(num_speculative_tokens=K, dynamic=True)


class ReplayProposer:
    """The true greedy continuation of each prompt, each token wrong with probability 1 - a."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], alpha: float, vocab: int):
        self.truth, self.alpha, self.vocab = truth, alpha, vocab

    def propose(self, requests, num_tokens):
        drafts = []
        for request, k in zip(requests, num_tokens, strict=True):
            truth = self.truth[tuple(request.prompt_token_ids)]
            start = len(request.output_token_ids)
            rng = random.Random(start * 7919 + len(request.prompt_token_ids))
            drafts.append(
                [
                    t if rng.random() < self.alpha else (t + 1) % self.vocab
                    for t in truth[start : start + k]
                ]
            )
        return drafts

    def finish(self, request):
        """Nothing is kept."""


def make_engine(path: Path) -> LLMEngine:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=2048),
        cache=CacheConfig(num_blocks=1024),
        speculative=PINNED,  # keyed draws; each mode sets the engine's speculator itself
    )
    return LLMEngine(path, config)


def run(engine, speculator, prompts, max_tokens) -> tuple[float, float, int]:
    """(tokens/s, acceptance, verify steps) of one generate of `prompts`."""
    engine.speculator = speculator
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    num_tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(speculator.accepted_per_step) if speculator is not None else 0
    return num_tokens / seconds, accepted / drafted if drafted else float("nan"), steps


def interleaved(modes: dict, rounds: int) -> dict[str, list[tuple]]:
    """Every mode once per round, the order rotating, each run beside a run without
    speculation at its batch size (`none b=N`: before it in even rounds, after it in odd ones),
    so that a ratio compares two runs seconds apart rather than a round apart (the read
    bandwidth of a shared machine can move by half within a minute). mode -> [(tokens/s,
    acceptance, tokens/s of the run beside it), ...]; a `none` mode collects all its runs."""
    results: dict[str, list[tuple]] = {name: [] for name in modes}
    names = [name for name in modes if not name.startswith("none ")]
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            base = "none " + name.rsplit(" ", 1)[1]
            order = (base, name) if round_index % 2 == 0 else (name, base)
            runs = {mode: modes[mode]() for mode in order}
            results[base].append(runs[base])
            results[name].append((*runs[name][:2], runs[base][0]))
    return results


def ratio_to_none(row: str, runs: list[tuple]) -> float:
    """Median of a mode's runs' ratios to the runs without speculation beside them."""
    return 1.0 if row == "none" else statistics.median(m[0] / m[2] for m in runs)


def greedy_truth(engine, prompts, max_tokens) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy continuation, from a run of exactly these prompts together: with
    random weights near-ties are common, and a product's sums round differently at another row
    count, so another batch's continuation can part from this one's at the first token (at
    batch 4, one request of four then had no draft accepted at any alpha)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    return {tuple(p.token_ids): o.token_ids for p, o in zip(prompts, outputs, strict=True)}


def replay_table(engine, rounds, max_tokens, step_costs) -> None:
    vocab = head_shape(engine.model.lm_head)[1]
    modes = {}
    for batch in BATCHES:
        batch_prompts = [engine.processor.build_text(QUESTIONS[i % 3]) for i in range(batch)]
        truth = greedy_truth(engine, batch_prompts, max_tokens)

        def plain(batch_prompts=batch_prompts):
            return run(engine, None, batch_prompts, max_tokens)

        modes[f"none b={batch}"] = plain
        for alpha in ALPHAS:
            for label, config, costs in (("K=4", PINNED, None), ("dyn", DYNAMIC, step_costs)):

                def replay(
                    prompts=batch_prompts, truth=truth, alpha=alpha, config=config, costs=costs
                ):
                    proposer = ReplayProposer(truth, alpha, vocab)
                    speculator = Speculator(config, proposer, SpeculationPolicy(config, costs))
                    return run(engine, speculator, prompts, max_tokens)

                modes[f"replay a={alpha} {label} b={batch}"] = replay
    results = interleaved(modes, rounds)
    print(f"\nreplay proposer, greedy, {max_tokens} tokens per request, K = 4 or dynamic")
    print(
        f"{'mode':<22}" + "".join(f"{f'b={b} tok/s':>13}{'x none':>8}{'acc':>6}" for b in BATCHES)
    )
    for row in ["none"] + [f"replay a={a} {m}" for a in ALPHAS for m in ("K=4", "dyn")]:
        line = f"{row:<22}"
        for batch in BATCHES:
            mine = results[f"{row} b={batch}"]
            ratio = ratio_to_none(row, mine)
            accept = statistics.median(m[1] for m in mine) if row != "none" else float("nan")
            line += f"{statistics.median(m[0] for m in mine):>13.1f}{ratio:>8.2f}{accept:>6.2f}"
        print(line)


def proposer_table(engine, draft_path, rounds, max_tokens) -> None:
    from stillcut.vision.pipeline import VisionPipeline

    pipeline = VisionPipeline(engine.path, draft_model=draft_path)  # the draft sees the videos
    videos = [pipeline.video(SAMPLES / name) for name in ("moving_object.mp4", "pan.mp4")]
    prompts = [engine.processor.build_text("What happens in this video?", [v]) for v in videos]
    prompts.append(engine.processor.build_text(QUESTIONS[0]))
    draft_config = SpeculativeConfig(
        method="draft", draft_model=str(draft_path), num_speculative_tokens=K, dynamic=False
    )
    draft = DraftProposer.for_target(engine, draft_config)
    draft_seconds: list[float] = []
    propose = draft.propose

    def timed_propose(requests, num_tokens):
        start = time.perf_counter()
        drafts = propose(requests, num_tokens)
        if any(drafts):  # a round that ran the draft model
            draft_seconds.append(time.perf_counter() - start)
        return drafts

    draft.propose = timed_propose
    proposers = {
        "ngram": lambda: NgramProposer(2, 4),
        "suffix": lambda: SuffixProposer(2, 4),
        "draft": lambda: draft,
    }
    modes = {}
    for batch in (1, 4):
        asked = [prompts[i % len(prompts)] for i in range(batch)]
        # each question twice, one after the other: the suffix proposer learns the first answer
        modes[f"none b={batch}"] = lambda asked=asked: _twice(engine, None, asked, max_tokens)
        for name, make in proposers.items():

            def speculating(asked=asked, make=make):
                speculator = Speculator(PINNED, make(), SpeculationPolicy(PINNED))
                return _twice(engine, speculator, asked, max_tokens)

            modes[f"{name} b={batch}"] = speculating
    results = interleaved(modes, rounds)
    print(f"\nreal proposers, repeated questions about two sample videos and one text, K = {K}")
    print(
        f"{'proposer':<10}"
        + "".join(f"{f'b={b} tok/s':>13}{'x none':>8}{'acc':>6}" for b in (1, 4))
    )
    for row in ("none", *proposers):
        line = f"{row:<10}"
        for batch in (1, 4):
            mine = results[f"{row} b={batch}"]
            ratio = ratio_to_none(row, mine)
            accept = statistics.median(m[1] for m in mine) if row != "none" else float("nan")
            line += f"{statistics.median(m[0] for m in mine):>13.1f}{ratio:>8.2f}{accept:>6.2f}"
        print(line)
    if draft_seconds:
        print(f"draft model: {statistics.median(draft_seconds) * 1e3:.1f} ms per proposal of "
              f"up to {K} tokens (median of {len(draft_seconds)})")  # fmt: skip


def _twice(engine, speculator, prompts, max_tokens):
    first = run(engine, speculator, prompts, max_tokens)
    second = run(engine, speculator, prompts, max_tokens)
    rates = [r for r in (first[1], second[1]) if r == r]
    return (first[0] + second[0]) / 2, statistics.mean(rates) if rates else float("nan"), 0


def floor_line(engine, rounds: int) -> None:
    model = engine.model
    read = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "embed_tokens", None) is not None:  # an untied table is only gathered
        read -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    flops = 2 * 5 * read // 4
    buffer = torch.ones(read // 4)
    square = torch.randn(2048, 2048)
    blocks = -(-(64 + 5) // engine.block_size)
    verify, reads, matmuls = [], [], []
    for _ in range(rounds * 5):
        verify.append(time_verify_step(engine.runner, 1, 5, blocks, sampled=False))
        start = time.perf_counter()
        buffer.sum()
        reads.append(time.perf_counter() - start)
        start = time.perf_counter()
        square @ square
        matmuls.append(time.perf_counter() - start)
    bandwidth = read / statistics.median(reads)
    rate = 2 * 2048**3 / statistics.median(matmuls)
    floor = max(read / bandwidth, flops / rate)
    step = statistics.median(verify)
    print(f"\nverify step, batch 1, 5 tokens: {step * 1e3:.1f} ms; floor {floor * 1e3:.1f} ms "
          f"(weights {read / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s = "
          f"{read / bandwidth * 1e3:.1f} ms; {flops / 1e9:.2f} GFLOP at {rate / 1e9:.0f} GFLOP/s "
          f"= {flops / rate * 1e3:.1f} ms); ratio {step / floor:.2f} (target <= 1.7)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = cached_checkpoint("random-demo", dtype="float32")
    draft_path = cached_checkpoint("random-demo", dtype="float32", text=DRAFT_TEXT)
    engine = make_engine(path)
    num_params = sum(p.numel() for p in engine.model.parameters())
    print(f"target: {num_params / 1e6:.0f}M parameters, fp32, {args.threads} threads; "
          f"{args.rounds} rounds, modes interleaved; a shared machine is noisy")  # fmt: skip
    step_costs = measure_step_costs(engine.runner, 16, K)
    print("calibrated verify cost at K = 0..4 (x a plain decode step), by batch size:")
    for batch, costs in step_costs.costs.items():
        print(f"  b={batch}: " + " ".join(f"{cost:.2f}" for cost in costs))
    floor_line(engine, args.rounds)
    replay_table(engine, args.rounds, args.tokens, step_costs)
    proposer_table(engine, draft_path, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
