"""Decode step time against the memory-bandwidth floor, and the loop around the model.

A batch-1 decode step of a small model is bound by reading its weights: every step reads each
layer's weights and the LM head once (the embedding table is only gathered, a few rows). Of a
mixture-of-experts layer a token reads only the experts it routes to (`num_experts_per_tok` of
them), and a recurrent layer reads its state row (a Mamba2 layer's conv and SSM states). The
floor is those bytes divided by the read bandwidth measured in this run, with the same thread
count (summing a buffer as large as what is read). At batch 8 the floor counts each row's state
but still one token's experts: a lower bound, since the rows may route to more of them. The
first table shows the engine's full decode step (schedule, inputs, forward, logits, sampling)
at batch 1 and 8 next to that floor, measured in back-to-back pairs (the ratio is the median of
the pairs' ratios); the target at batch 1, for a model of at least 100M parameters, is a ratio
of 1.25 or less (1.3 for a hybrid with recurrent layers, whose step also scans states and
routes tokens through many small expert matrices). On CPU a model runs its decode steps as one
native call (`kernels/cpu`) where the kernel builds; the last row runs the same steps
through the model's torch ops, for comparison. The native call also makes the step's logits
(the LM head's product in the same threaded region), so it is shown as one part; beside the
model's forward (which checks the weights and the step's inputs first) stands that call alone
and its ratio to the floor: what the step would be with no host work at all.

The second table is the loop around the model: what scheduling, input preparation, sampling,
detokenization and output building add to a step. Each round is one `LLMEngine.generate`, at
batch 1 and 16, interleaved step by step with the model call alone: after each decode step the
bench replays that step's forward and logits on its inputs (time it leaves out of the
generate's). It gives the model call, the whole `engine.step()`, and generate's mean wall time
per token from its second token on (each request gets one token a step); ratios are medians of
the rounds' ratios of means. Targets: generate per token <= 1.08x the model call at batch 1,
<= 1.05x at batch 16. Then one long greedy generation (2,048 tokens) records each step's host
time outside the model call: the median of its last 100 steps must be within 10 % of its first
100. Minutes apart on a shared machine the same work can take other times, so a second such
generation counts instead (Python calls and peak bytes the host allocates per step), which no
neighbour can blur. Last, where the host time goes, per step, from one instrumented pass per
batch.

The default model is the `lm180m` preset: the `random-demo` shape with an untied 152k
vocabulary, 180M language-model parameters (random weights; only the shapes matter here);
`--family` picks another family's preset (`--family qwen3_5 --preset bench`: the Qwen3.5
hybrid, 105M). With `--dense-twin`, a model with recurrent layers is set beside a dense Qwen3
(`qwen3_vl`) of the same hidden size, layers, attention heads and vocabulary whose MLP width
is chosen so that its step reads as many bytes as the hybrid's does (weights and recurrent
state): both decode at batch 1 taking turns round by round, each step beside the read of its
own bytes, and the table gives each one's step, floor and ratio, and the hybrid's step over
the twin's (medians of the rounds' ratios): what the recurrent layers cost beyond their bytes.

    python bench/decode_roofline.py [--preset lm180m [--family F] | --model PATH] [--threads N]
        [--rounds 25] [--loop-rounds 7] [--long 2048] [--dense-twin]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
import time
import tracemalloc
import types
from collections.abc import Callable

import torch

from stillcut.engine import runner as runner_module
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams

TARGET = 1.25
HYBRID_TARGET = 1.3  # a model with recurrent layers
LOOP_TARGETS = {1: 1.08, 16: 1.05}  # generate per token / model call
LONG_TARGET = 0.10  # last 100 steps' host time within 10 % of the first 100's
LOOP_TOKENS = 48  # tokens per generate call in a loop round
PROMPT = "Tell me about the sea."


GATHERED = ("embed_tokens", "embeddings")  # names of untied embedding tables


def weight_bytes_per_step(model: torch.nn.Module) -> tuple[int, int]:
    """(weight bytes a batch-1 decode step reads, parameter count). An untied embedding table
    is only gathered, so it is left out; a tied model reads its head, which doubles as the
    table. Stacked experts (`experts_*` tensors `[E, ...]`, int8 scales included) count as the
    `num_experts_per_tok` of E that a token routes to."""
    total_params = sum(p.numel() for p in model.parameters())
    read = 0
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in GATHERED:
            continue
        share = 1.0
        if leaf.startswith("experts_"):
            share = model.config.num_experts_per_tok / param.shape[0]
        read += int(param.numel() * param.element_size() * share)
    return read, total_params


def state_bytes_per_row(runner) -> int:
    """Bytes of one request's recurrent states (every recurrent layer's), read each step."""
    states = runner.recurrent_states.values()
    return sum(t[0].numel() * t.element_size() for tensors in states for t in tensors)


def read_seconds(buffer: torch.Tensor) -> float:
    """Seconds to read `buffer` once (a sum: one streaming pass)."""
    start = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - start


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


class PartTimer:
    """Seconds spent in each call of some methods, recorded by wrapping them on the given
    instances (the engine, its scheduler, runner or model) or modules (a module's function)."""

    def __init__(self, parts: dict[str, tuple[object, str]]) -> None:
        self.parts = parts
        self.calls: dict[str, list[tuple[float, float]]] = {name: [] for name in parts}
        self._module_functions = {
            (owner, method): getattr(owner, method)
            for owner, method in parts.values()
            if isinstance(owner, types.ModuleType)
        }
        for name, (owner, method) in parts.items():
            setattr(owner, method, self._timed(getattr(owner, method), self.calls[name]))

    def stop(self) -> None:
        """Unwrap the methods (back to the class's own) and the module functions."""
        for owner, method in self.parts.values():
            if (owner, method) in self._module_functions:
                setattr(owner, method, self._module_functions[owner, method])
            else:
                delattr(owner, method)

    def seconds(self, name: str) -> list[float]:
        return [end - start for start, end in self.calls[name]]

    def starts(self, name: str) -> list[float]:
        return [start for start, _ in self.calls[name]]

    @staticmethod
    def _timed(method, calls: list[tuple[float, float]]):
        def timed_method(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            calls.append((start, time.perf_counter()))
            return result

        return timed_method


def model_parts(model: torch.nn.Module) -> dict[str, tuple[object, str]]:
    return {"forward": (model, "forward"), "compute_logits": (model, "compute_logits")}


def model_seconds(timer: PartTimer) -> list[float]:
    """Seconds in the model per step: its forward and its logits (one call of each a step)."""
    forward, logits = timer.seconds("forward"), timer.seconds("compute_logits")
    return [f + c for f, c in zip(forward, logits, strict=True)]


def start_decoding(engine: LLMEngine, batch: int, max_tokens: int) -> list[str]:
    """`batch` requests, stepped until every one decodes, and a few steps more."""
    prompt = engine.processor.build_text(PROMPT)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    while any(
        engine.scheduler.requests[i].num_computed_tokens < len(prompt.token_ids) for i in ids
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    return ids


def stop_decoding(engine: LLMEngine, ids: list[str]) -> None:
    for request_id in ids:
        engine.abort(request_id)
    engine.step()


def paired_rounds(engine: LLMEngine, batch: int, rounds: int, num_bytes: int) -> list[tuple]:
    """`rounds` pairs of (median seconds of 3 engine steps while `batch` requests all decode,
    seconds to read `num_bytes`) measured back to back, so that both see the same machine: on a
    shared host the read bandwidth drifts by tens of percent within a minute."""
    buffer = torch.ones(num_bytes // 4)
    ids = start_decoding(engine, batch, max_tokens=3 * rounds + 16)
    pairs = []
    for _ in range(rounds):
        steps = [timed(engine.step) for _ in range(3)]
        pairs.append((statistics.median(steps), read_seconds(buffer)))
    stop_decoding(engine, ids)
    return pairs


def replay_model_call(runner, batch) -> float:
    """Seconds of the model call of a decode step the runner just ran, run again alone:
    forward over the step's inputs (still in the runner's buffers), then logits of every row.
    It writes the same keys and values to the same slots, so the engine's state stays as is."""
    metadata = dataclasses.replace(batch.metadata, plans={})  # as fresh as the step's was
    start = time.perf_counter()
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, metadata)
        runner.model.compute_logits(hidden)
    return time.perf_counter() - start


def loop_round(engine: LLMEngine, batch: int) -> tuple[float, float, float]:
    """Mean seconds of (the model call, an engine step, a generated token) over one
    `generate` of `batch` prompts, interleaved step by step: after each of its decode steps
    the bench replays that step's model call alone, and leaves that time out of the
    generate's. Means, not medians: a generate's mean per token takes the pauses a shared
    machine inflicts, so the model calls it is compared with must take theirs too."""
    runner, step = engine.runner, engine.step
    prepare = runner_module.prepare_inputs
    last_batch, replays, steps, extra = [], [], [], []

    def capturing(prepared_runner, output):
        last_batch[:] = [prepare(prepared_runner, output)]
        return last_batch[0]

    def stepping():
        started = time.perf_counter()
        outputs = step()
        ended = time.perf_counter()
        (last,) = last_batch
        if last.sample_index is None:  # a step of decodes: every row sampled
            replays.append(replay_model_call(runner, last))
            steps.append((started, ended))
            extra.append(time.perf_counter() - ended)
        return outputs

    runner_module.prepare_inputs, engine.step = capturing, stepping
    prompt = engine.processor.build_text(PROMPT)
    try:
        engine.generate([prompt] * batch, SamplingParams(max_tokens=LOOP_TOKENS, ignore_eos=True))
        finished = time.perf_counter()
    finally:
        runner_module.prepare_inputs = prepare
        del engine.step
    assert len(steps) == LOOP_TOKENS - 1, len(steps)
    starts = [started for started, _ in steps]
    walls = [b - a - e for a, b, e in zip(starts, [*starts[1:], finished], extra, strict=True)]
    step_seconds = [ended - started for started, ended in steps]
    return statistics.mean(replays), statistics.mean(step_seconds), statistics.mean(walls)


def long_generation(engine: LLMEngine, num_tokens: int) -> list[float]:
    """Host seconds outside the model call of each decode step of one greedy generation: a
    step's wall time (from its start to the next step's start, so the loop of `generate`
    counts) less its forward and logits."""
    timer = PartTimer({"step": (engine, "step"), **model_parts(engine.model)})
    prompt = engine.processor.build_text(PROMPT)
    try:
        engine.generate([prompt], SamplingParams(max_tokens=num_tokens, ignore_eos=True))
        ended = time.perf_counter()
    finally:
        timer.stop()
    starts = timer.starts("step")
    walls = [b - a for a, b in zip(starts, [*starts[1:], ended], strict=True)]
    model = model_seconds(timer)
    assert len(model) == len(walls) == num_tokens, (len(model), len(walls))
    return [wall - inside for wall, inside in zip(walls[1:], model[1:], strict=True)]


MODEL_AND_STEP = ("forward", "compute_logits", "step")


def host_work(engine: LLMEngine, num_tokens: int, window: int = 100) -> list[list[tuple]]:
    """(Python calls, peak bytes the host allocates) of each step in the first and the last
    `window` decode steps of one greedy generation. Counts, not times: on a shared machine
    minutes apart the same work takes different times, but not different counts."""
    step, steps = engine.step, itertools.count()
    counts: list[tuple[int, int]] = []

    def counting():
        index = next(steps)
        if not (1 <= index <= window or index > num_tokens - window):
            return step()
        calls = itertools.count()
        tracemalloc.start()
        sys.setprofile(lambda frame, event, arg: event.endswith("call") and next(calls))
        try:
            return step()
        finally:
            sys.setprofile(None)
            counts.append((next(calls), tracemalloc.get_traced_memory()[1]))
            tracemalloc.stop()

    engine.step = counting
    prompt = engine.processor.build_text(PROMPT)
    try:
        engine.generate([prompt], SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    finally:
        del engine.step
    return [counts[:window], counts[-window:]]


def host_breakdown(engine: LLMEngine, batch: int, num_steps: int = 20) -> dict[str, float]:
    """Median microseconds per decode step in each part of the loop around the model."""
    runner, scheduler = engine.runner, engine.scheduler
    ids = start_decoding(engine, batch, max_tokens=num_steps + 8)
    timer = PartTimer(
        {
            "step": (engine, "step"),
            "schedule": (scheduler, "schedule"),
            "rows": (runner, "_update_rows"),
            "inputs": (runner_module, "prepare_inputs"),
            "sample": (runner, "_sample"),
            "update": (scheduler, "update_from_output"),
            "outputs": (engine.outputs, "process"),
            **model_parts(engine.model),
        }
    )
    try:
        for _ in range(num_steps):
            engine.step()
    finally:
        timer.stop()
    stop_decoding(engine, ids)
    model, steps = model_seconds(timer), timer.seconds("step")
    per_step = {name: timer.seconds(name) for name in timer.parts if name not in MODEL_AND_STEP}
    outputs = per_step.pop("outputs")  # one call per request: summed per step
    per_step["outputs"] = [sum(outputs[i : i + batch]) for i in range(0, len(outputs), batch)]
    parts = {name: statistics.median(values) * 1e6 for name, values in per_step.items()}
    outside = statistics.median(s - m for s, m in zip(steps, model, strict=True)) * 1e6
    return {"outside the model": outside, **parts, "other": outside - sum(parts.values())}


def roofline_table(engine: LLMEngine, rounds: int) -> None:
    weight_bytes, num_params = weight_bytes_per_step(engine.model)
    state_bytes = state_bytes_per_row(engine.runner)
    head_bytes = engine.model.lm_head.numel() * engine.model.lm_head.element_size()
    native = engine.model.cpu_decoder
    path = "native step" if native is not None else "torch ops"
    runs = [(1, path), (8, path)] + ([(1, "torch ops")] if native is not None else [])
    rows, parts = [], {}
    for batch, how in runs:
        engine.model.cpu_decoder = native if how == "native step" else None
        timer = None
        if not rows:
            # the model's calls, and the native step's own (its kernel and the call's wrapper)
            kernel = {"kernel": (native, "decode")} if how == "native step" else {}
            timer = PartTimer({**model_parts(engine.model), **kernel})
        num_bytes = weight_bytes + batch * state_bytes
        pairs = paired_rounds(engine, batch, rounds, num_bytes)
        if timer is not None:
            timer.stop()
            parts = {name: statistics.median(timer.seconds(name)) for name in timer.parts}
        step = statistics.median(p[0] for p in pairs)
        floor = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        rows.append((batch, how, step, floor, ratio, num_bytes / floor))
    engine.model.cpu_decoder = native
    config = engine.model.config
    experts = (
        f" (experts: {config.num_experts_per_tok} of {config.num_experts} per token)"
        if getattr(config, "num_experts", 0)
        else ""
    )
    states = f", {state_bytes / 1e3:.0f} kB of recurrent state per row" if state_bytes else ""
    print(
        f"model: {num_params / 1e6:.1f}M parameters, {weight_bytes / 1e6:.1f} MB of weights "
        f"read per step{experts}{states}, {torch.get_num_threads()} thread(s), {rounds} paired "
        "rounds"
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
    num_bytes = weight_bytes + state_bytes
    layers, head = parts["forward"], parts["compute_logits"]
    if native is not None and native.vocab:  # the head's product is in the native call
        floor = num_bytes / bandwidth
        where = (
            f"the model's forward (layers and head) {layers * 1e3:.2f} ms, of which the native "
            f"call {parts['kernel'] * 1e3:.2f} ms ({parts['kernel'] / floor:.2f}x their floor "
            f"{floor * 1e3:.2f}), logits handed on {head * 1e3:.2f} ms"
        )
    else:
        where = (
            f"layers {layers * 1e3:.2f} ms (their weights' floor "
            f"{(num_bytes - head_bytes) / bandwidth * 1e3:.2f}), head {head * 1e3:.2f} ms (floor "
            f"{head_bytes / bandwidth * 1e3:.2f})"
        )
    print(
        f"batch 1, where a step goes: {where}, outside the model "
        f"{(step - layers - head) * 1e3:.2f} ms"
    )
    ratio, target = rows[0][4], HYBRID_TARGET if state_bytes else TARGET
    verdict = "met" if ratio <= target else "MISSED"
    print(
        f"batch 1: {ratio:.2f}x the floor, median of paired rounds (target <= {target}: {verdict})"
    )


def loop_table(engine: LLMEngine, rounds: int) -> None:
    results = {batch: [loop_round(engine, batch) for _ in range(rounds)] for batch in LOOP_TARGETS}
    print(f"\nthe loop around the model: {rounds} interleaved rounds per batch, medians of means")
    print(
        f"{'batch':>6}{'model ms':>10}{'step ms':>9}{'generate ms/token':>19}"
        f"{'step/model':>12}{'generate/model':>16}{'target':>8}  verdict"
    )
    for batch, target in LOOP_TARGETS.items():
        rows = results[batch]
        model, step, generate = (statistics.median(r[i] for r in rows) for i in range(3))
        step_ratio = statistics.median(r[1] / r[0] for r in rows)
        ratio = statistics.median(r[2] / r[0] for r in rows)
        verdict = "met" if ratio <= target else "MISSED"
        print(
            f"{batch:>6}{model * 1e3:>10.2f}{step * 1e3:>9.2f}{generate * 1e3:>19.2f}"
            f"{step_ratio:>12.3f}{ratio:>16.3f}{target:>8.2f}  {verdict}"
        )


def long_line(engine: LLMEngine, num_tokens: int) -> None:
    outside = long_generation(engine, num_tokens)
    first, last = statistics.median(outside[:100]), statistics.median(outside[-100:])
    change = last / first - 1
    verdict = "met" if abs(change) <= LONG_TARGET else "MISSED"
    print(
        f"\n{num_tokens}-token greedy generation, host time per step outside the model call "
        f"(median of 100 steps): first 100 {first * 1e3:.3f} ms, last 100 {last * 1e3:.3f} ms, "
        f"{change:+.1%} (target within {LONG_TARGET:.0%}: {verdict})"
    )
    (calls, peaks) = (
        [statistics.median(step[i] for step in window) for window in host_work(engine, num_tokens)]
        for i in range(2)
    )
    print(
        f"the same, counted in a second generation: Python calls per step {calls[0]:.0f} then "
        f"{calls[1]:.0f}; peak bytes allocated per step {peaks[0]:.0f} then {peaks[1]:.0f}"
    )


def breakdown_table(engine: LLMEngine) -> None:
    columns = {batch: host_breakdown(engine, batch) for batch in LOOP_TARGETS}
    print("\nwhere the host time of a decode step goes (us, medians of 20 instrumented steps)")
    print(f"{'part':<20}" + "".join(f"{f'batch {b}':>10}" for b in columns))
    for name in columns[1]:
        print(f"{name:<20}" + "".join(f"{column[name]:>10.0f}" for column in columns.values()))


def dense_twin(engine: LLMEngine, state_bytes: int) -> LLMEngine:
    """A dense Qwen3 engine whose batch-1 step reads the bytes of `engine`'s (weights and one
    row's recurrent state): the model's hidden size, layers, attention heads, vocabulary,
    tying and stored dtype, its MLP width solved for the bytes (random weights)."""
    config, model = engine.model.config, engine.model
    weight_bytes, _ = weight_bytes_per_step(model)
    element = model.lm_head.element_size()
    hidden, layers, head_dim = config.hidden_size, config.num_layers, config.head_dim
    heads, kv_heads = config.num_heads, config.num_kv_heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    free = (weight_bytes + state_bytes) // element - hidden * config.vocab_size - layers * attention
    intermediate = free // (3 * hidden * layers) // 32 * 32
    text = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
    }
    path = cached_checkpoint(
        "tiny",
        family="qwen3_vl",
        dtype=str(model.lm_head.dtype).removeprefix("torch."),
        tie_word_embeddings=config.tie_word_embeddings,
        text=text,
    )
    return LLMEngine(path, engine.config)


def side_by_side(engines: dict[str, LLMEngine], rounds: int) -> None:
    """Batch-1 steps of each engine (median of 3) beside the read of its bytes, the engines
    taking turns round by round; the first is compared with the others."""
    setups = {}
    for name, engine in engines.items():
        num_bytes = weight_bytes_per_step(engine.model)[0] + state_bytes_per_row(engine.runner)
        ids = start_decoding(engine, 1, max_tokens=3 * rounds + 16)
        setups[name] = (engine, num_bytes, torch.ones(num_bytes // 4), ids)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, (engine, _, buffer, _) in setups.items():
            steps = [timed(engine.step) for _ in range(3)]
            results[name].append((statistics.median(steps), read_seconds(buffer)))
    for engine, _, _, ids in setups.values():
        stop_decoding(engine, ids)
    first = next(iter(engines))
    print(f"\nside by side at batch 1, {rounds} rounds taking turns (medians)")
    print(
        f"{'model':<40}{'MB read':>9}{'step ms':>9}{'floor ms':>10}{'ratio':>8}{'first/this':>12}"
    )
    for name, pairs in results.items():
        step = statistics.median(p[0] for p in pairs)
        floor = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        versus = statistics.median(a[0] / b[0] for a, b in zip(results[first], pairs, strict=True))
        print(
            f"{name:<40}{setups[name][1] / 1e6:>9.1f}{step * 1e3:>9.2f}{floor * 1e3:>10.2f}"
            f"{ratio:>8.2f}{versus:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="lm180m", help="factory preset (default: lm180m)")
    parser.add_argument("--family", help="the preset's family (default: the factory's)")
    parser.add_argument(
        "--dense-twin", action="store_true", help="a hybrid beside a dense Qwen3 of its bytes"
    )
    parser.add_argument("--model", help="checkpoint folder instead of a preset")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=25, help="paired step/floor rounds")
    parser.add_argument(
        "--loop-rounds", type=int, default=7, help="rounds per loop batch (0: no loop table)"
    )
    parser.add_argument(
        "--long", type=int, default=2048, help="tokens of the long generation (0: none)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=max(args.long, 1024) + 128
        ),
        cache=CacheConfig(num_blocks=512),
    )
    family = {"family": args.family} if args.family else {}
    engine = LLMEngine(args.model or cached_checkpoint(args.preset, **family), config)
    roofline_table(engine, args.rounds)
    state_bytes = state_bytes_per_row(engine.runner)
    if args.dense_twin and state_bytes:
        twin = dense_twin(engine, state_bytes)
        hybrid = f"{engine.model_config.model_type} (hybrid)"
        side_by_side({hybrid: engine, "qwen3_vl (dense, same bytes)": twin}, args.rounds)
    if args.loop_rounds > 0:  # (0: the first table only)
        loop_table(engine, args.loop_rounds)
    if args.long > 0:
        long_line(engine, args.long)
    breakdown_table(engine)


if __name__ == "__main__":
    main()
