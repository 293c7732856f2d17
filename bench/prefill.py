"""Prefill speed: tokens/s of one long prompt per compute mode, against torch's own GEMM rate.

One random checkpoint of a factory preset (default `lm180m`, stored in bfloat16) is loaded
once per mode; each round prefills a prompt of each length once per mode, in turn (A, B, C,
A, B, C ...), and the table gives medians. A prefill is `generate` of one token from a fresh
prompt (prefix caching off, the whole prompt in one step), so it is the time to first token
of a text prompt. Modes:

  fp32           float32 weights, float32 arithmetic
  bf16 widened   bfloat16 weights widened to float32 for each product (compute_dtype=float32)
  bf16           bfloat16 weights, bfloat16 arithmetic (compute_dtype=bfloat16): the native
                 product (`kernels.cpu.gemm`, AMX or AVX-512) reading the packed weight
  int8           int8 weights (per output channel), widened to float32
  w8a8           int8 weights, rows quantized per token, exact int32 sums: the native product
                 (AMX `tdpbssd` or AVX-512 `vpdpbusd`) reading the quad panels
  bf16 torch     bf16 with torch's GEMMs instead of the native products (the weight unpacked
                 for each product; `STILLCUT_CPU_FLAGS` emptied while it runs)
  w8a8 torch     w8a8 likewise (torch's `_int_mm`)

Beside each mode: "linear s", the time the prefill spent in its linear layers' products
(every call of `matmul.linear` in it timed; the LM head of the last row aside; medians like
the rest); "vs torch", torch's own GEMM time for the same products (x @ w of every
projection's shape at that many rows, in that mode's arithmetic) over that: the linear
layers' FLOPs per second against torch's GEMM rate, target >= 0.8 at 4,096 tokens; and
"rest s", the prefill's median less its linear time (attention, norms, rotary and the
runner, reported apart). Where the CPU has no bfloat16 dot products, bf16
prints "skipped"; without integer dot products (avx512_vnni, avx_vnni, amx_int8), w8a8 does.

llama.cpp (`--llama-bench PATH --gguf NAME=FILE ...`): in every round, after stillcut's modes,
`llama-bench -p N -n 0 -r 1` runs on each GGUF named, for the same prompt length and threads
(interleaved with stillcut's, a fresh process each time, after its own warm-up run); its
tokens/s medians are printed beside the stillcut mode of the same arithmetic (F32: fp32,
BF16: bf16, Q8_0: w8a8) and their ratio (targets at 512 tokens: bf16 >= 1.0x BF16, w8a8 >=
1.0x Q8_0). To build one: `pip download --no-binary :all: llama-cpp-python` fetches a source
archive that vendors llama.cpp (`vendor/llama.cpp`: `cmake -B build && cmake --build build
--target llama-bench`), and its `convert_hf_to_gguf.py CHECKPOINT --outtype f32|bf16|q8_0`
converts our checkpoint's language model (it needs the `sentencepiece` package; the
checkpoint is `engine.factory.cached_checkpoint(PRESET, dtype="bfloat16")`).

    python bench/prefill.py [--preset lm180m] [--tokens 512,4096] [--rounds 3]
        [--modes "fp32,bf16,int8,w8a8,bf16 torch,w8a8 torch"]
        [--llama-bench PATH --gguf BF16=model-bf16.gguf ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.kernels.cpu_flags import BF16_FLAGS, FLAGS_VARIABLE, cpu_flags

MODES = {
    "fp32": {"dtype": "float32", "compute_dtype": "float32"},
    "bf16 widened": {"dtype": "bfloat16", "compute_dtype": "float32"},
    "bf16": {"dtype": "bfloat16", "compute_dtype": "bfloat16"},
    "int8": {"quantization": "int8", "compute_dtype": "float32"},
    "w8a8": {"quantization": "w8a8", "compute_dtype": "float32"},
    "bf16 torch": {"dtype": "bfloat16", "compute_dtype": "bfloat16"},
    "w8a8 torch": {"quantization": "w8a8", "compute_dtype": "float32"},
}
TORCH_PRODUCTS = ("bf16 torch", "w8a8 torch")  # no CPU flags: no native products
NEEDS = {"bf16": BF16_FLAGS, "w8a8": ("avx512_vnni", "avx_vnni", "amx_int8")}
NEEDS.update({"bf16 torch": NEEDS["bf16"], "w8a8 torch": NEEDS["w8a8"]})
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def make_engine(path, mode: str, max_tokens: int) -> LLMEngine:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_tokens, max_model_len=max_tokens + 1, max_num_seqs=1
        ),
        cache=CacheConfig(num_blocks=2 * (max_tokens // 16 + 2), enable_prefix_caching=False),
        **MODES[mode],
    )
    return LLMEngine(path, config)


def prefill_seconds(
    engine: LLMEngine, num_tokens: int, seed: int, torch_products: bool
) -> tuple[float, float]:
    """One prefill's seconds, and the seconds of it spent in the linear layers' products."""
    flags = os.environ.get(FLAGS_VARIABLE)
    if torch_products:
        os.environ[FLAGS_VARIABLE] = ""
    try:
        with timed_linear() as spent:
            total = _timed_prefill(engine, num_tokens, seed)
        return total, spent[0]
    finally:
        if flags is None:
            os.environ.pop(FLAGS_VARIABLE, None)
        else:
            os.environ[FLAGS_VARIABLE] = flags


def _timed_prefill(engine: LLMEngine, num_tokens: int, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    prompt = torch.randint(0, vocab, (num_tokens,), generator=generator).tolist()
    start = time.perf_counter()
    engine.generate([prompt], ONE_TOKEN)
    return time.perf_counter() - start


@contextlib.contextmanager
def timed_linear():
    """While inside, every call of `matmul.linear` from a model's layers (as each model module
    imported it; not `matmul`'s own calls, which are the LM head's) adds its wall time (about
    a microsecond more per call) to the yielded list's one entry."""
    from stillcut.engine.models import matmul

    original, spent = matmul.linear, [0.0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    modules = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("stillcut.engine.models")
        and module is not matmul
        and getattr(module, "linear", None) is original
    ]
    for module in modules:
        module.linear = timed
    try:
        yield spent
    finally:
        for module in modules:
            module.linear = original


def linear_shapes(engine: LLMEngine) -> list[tuple[int, int]]:
    """`[in, out]` of every projection of every layer (as stored, any layout)."""
    from stillcut.engine.models.matmul import head_shape

    return [
        head_shape(matrix.weight)
        for layer in engine.model.layers
        for matrix in layer.matrices.values()
    ]


def gemm_seconds(shapes: list[tuple[int, int]], num_rows: int, dtype: torch.dtype) -> float:
    """torch's own time for `x @ w` of every shape at `num_rows` rows in `dtype` (median of
    3, after a warm-up)."""
    total = 0.0
    for num_in, num_out in sorted(set(shapes)):
        x = torch.randn(num_rows, num_in).to(dtype)
        w = torch.randn(num_in, num_out).to(dtype)
        product = torch._int_mm if dtype == torch.int8 else torch.mm
        product(x, w)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            product(x, w)
            times.append(time.perf_counter() - start)
        total += statistics.median(times) * shapes.count((num_in, num_out))
    return total


LLAMA_MODES = {"F32": "fp32", "BF16": "bf16", "Q8_0": "w8a8"}


def llama_tokens_per_second(path: str, gguf: str, num_tokens: int) -> float:
    """One `llama-bench` run's prompt tokens/s for `num_tokens`."""
    command = [path, "-m", gguf, "-p", str(num_tokens), "-n", "0", "-r", "1", "-o", "json"]
    command += ["-t", str(torch.get_num_threads())]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    (test,) = json.loads(result.stdout)
    return float(test["avg_ts"])


def print_llama(ggufs: dict[str, str], lengths: list[int], llama: dict, ours: dict) -> None:
    print("\nllama.cpp, interleaved with the rounds above (medians):")
    print("{:8} {:>7} {:>10}  {:14} {:>10} {:>7}".format(
        "GGUF", "tokens", "tokens/s", "stillcut mode", "tokens/s", "ratio"
    ))  # fmt: skip
    for n in lengths:
        for name in ggufs:
            theirs = statistics.median(llama[name, n])
            mode = LLAMA_MODES.get(name.upper())
            if mode is None or (mode, n) not in ours:
                print(f"{name:8} {n:7} {theirs:10.1f}")
                continue
            mine = n / statistics.median(ours[mode, n])
            print(f"{name:8} {n:7} {theirs:10.1f}  {mode:14} {mine:10.1f} {mine / theirs:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="lm180m")
    parser.add_argument("--tokens", default="512,4096")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="fp32,bf16 widened,bf16,int8,w8a8")
    parser.add_argument("--llama-bench", help="path of llama.cpp's llama-bench")
    parser.add_argument("--gguf", action="append", default=[], help="NAME=FILE, repeated")
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    ggufs = dict(named.partition("=")[::2] for named in args.gguf)
    if ggufs and not args.llama_bench:
        parser.error("--gguf needs --llama-bench")
    modes = args.modes.split(",")
    for mode, flags in NEEDS.items():
        if mode in modes and not cpu_flags().intersection(flags):
            print(f"{mode}: skipped (no {' or '.join(flags)} in this CPU's flags)")
            modes.remove(mode)
    path = cached_checkpoint(args.preset, dtype="bfloat16")
    engines = {mode: make_engine(path, mode, max(lengths)) for mode in modes}
    print(f"{args.preset}: {torch.get_num_threads()} threads, {args.rounds} interleaved rounds")
    seconds = {(mode, n): [] for mode in modes for n in lengths}
    in_linear = {(mode, n): [] for mode in modes for n in lengths}
    llama = {(name, n): [] for name in ggufs for n in lengths}
    for round_index in range(args.rounds + 1):  # the first round warms up
        for n in lengths:
            for mode, engine in engines.items():
                elapsed, linear = prefill_seconds(engine, n, round_index, mode in TORCH_PRODUCTS)
                if round_index:
                    seconds[mode, n].append(elapsed)
                    in_linear[mode, n].append(linear)
            for name, gguf in ggufs.items():
                rate = llama_tokens_per_second(args.llama_bench, gguf, n)
                if round_index:
                    llama[name, n].append(rate)
    header = ("mode", "tokens", "tokens/s", "linear s", "vs torch", "rest s")
    print("{:14} {:>7} {:>10} {:>9} {:>9} {:>8}".format(*header))
    for n in lengths:
        for mode, engine in engines.items():
            median = statistics.median(seconds[mode, n])
            linear = statistics.median(in_linear[mode, n])
            arithmetic = engine.weight_format.matrix_dtype
            ratio = gemm_seconds(linear_shapes(engine), n, arithmetic) / linear
            row = (mode, n, n / median, linear, ratio, median - linear)
            print("{:14} {:7} {:10.1f} {:9.3f} {:9.2f} {:8.3f}".format(*row))
    if ggufs:
        print_llama(ggufs, lengths, llama, seconds)


if __name__ == "__main__":
    main()
