"""The ways a prefill's long products can run on CPU, side by side, on one model's shapes.

Each of a preset's projection shapes (`[in, out]`: qkv, o, gate/up, down) is timed at each row
count through `matmul.linear`, as prefill calls it, in every option the CPU allows:

  bf16 unpacked      today's torch path: the packed bfloat16 weight copied unpacked, the rows
                     rounded to bfloat16, torch's bf16 GEMM (oneDNN), the result widened back
  bf16 plain         the layout option: the weight kept as a contiguous [in, out] (no unpack),
                     the rest as above
  bf16 tiles         the native product reading the packed weight, AMX tiles (`kernels.cpu.gemm`)
  bf16 vector        the same with AVX-512 `vdpbf16ps`
  int8 weight-only   `--quantization int8`: the int8 weight widened to float32, float32 GEMM
  w8a8 _int_mm       the torch W8A8 path: rows quantized, quad panels unpacked, `_int_mm`
  w8a8 tiles         the native W8A8 product reading the quad panels, AMX `tdpbssd`
  w8a8 vector        the same with AVX-512 `vpdpbusd`
  fp32               torch's float32 GEMM of a float32 weight (for scale)

An option whose CPU flag is missing is skipped (its line says so). Rounds are interleaved (every
option once per shape, then the next round) and the table gives medians of the whole layer's
time (its four products) and its GFLOP/s. `--decode` also times the layout option's cost to
decode: one row through the native product with the bf16 weight packed and as a plain [in,
out], over copies that outgrow the caches (a decode step reads its weights from memory).

    python bench/prefill_products.py [--preset lm180m] [--rows 512,4096] [--rounds 5]
        [--threads N] [--decode]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from stillcut.engine.models.matmul import linear, stored_matrix
from stillcut.engine.models.qwen2_vl.checkpoint import PRESETS
from stillcut.engine.quantization import quantize_int8
from stillcut.kernels.cpu.decoder import native_matrix
from stillcut.kernels.cpu.packing import pack_matrix, pack_quads, quads_fit
from stillcut.kernels.cpu_flags import FLAGS_VARIABLE, cpu_flags

# option -> (the CPU flags it runs under, the stored weight's kind, its arithmetic)
OPTIONS = {
    "bf16 unpacked": ("", "packed", torch.bfloat16),
    "bf16 plain": ("", "plain", torch.bfloat16),
    "bf16 tiles": ("amx_bf16", "packed", torch.bfloat16),
    "bf16 vector": ("avx512_bf16", "packed", torch.bfloat16),
    "int8 weight-only": ("", "int8", None),
    "w8a8 _int_mm": ("", "int8", torch.int8),
    "w8a8 tiles": ("amx_int8", "int8", torch.int8),
    "w8a8 vector": ("avx512_vnni", "int8", torch.int8),
    "fp32": ("", "fp32", None),
}
FROM_MEMORY_BYTES = 256 << 20


def projection_shapes(preset: str) -> list[tuple[int, int]]:
    """`[in, out]` of a decoder layer's qkv, o, gate/up and down projections."""
    text = PRESETS[preset].text
    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    kv_width = 2 * text["num_key_value_heads"] * (hidden // heads)
    intermediate = text["intermediate_size"]
    return [(hidden, hidden + kv_width), (hidden, hidden), (hidden, 2 * intermediate)] + [
        (intermediate, hidden)
    ]


def stored(kind: str, num_in: int, num_out: int, arithmetic) -> object:
    """A random `[in, out]` weight stored as `kind`, prepared for `linear`."""
    weight = torch.randn(num_in, num_out) / num_in**0.5
    if kind == "fp32":
        return stored_matrix(weight)
    if kind == "int8":
        values, scale = quantize_int8(weight.T, 0)
        values = values.T.contiguous()
        fits = quads_fit(torch.int8, "cpu", num_in, num_out)
        return stored_matrix(pack_quads(values) if fits else values, scale, arithmetic=arithmetic)
    weight = weight.bfloat16()
    return stored_matrix(pack_matrix(weight) if kind == "packed" else weight, arithmetic=arithmetic)


def prefill_options(shapes, row_counts, rounds: int, options: list[str]) -> None:
    matrices = {
        (option, shape): stored(OPTIONS[option][1], *shape, OPTIONS[option][2])
        for option in options
        for shape in shapes
    }
    inputs = {n: {s: torch.randn(n, s[0]) for s in set(shapes)} for n in row_counts}
    seconds = {(o, n): [] for o in options for n in row_counts}
    for round_index in range(rounds + 1):  # the first round warms up
        for n in row_counts:
            for option in options:
                os.environ[FLAGS_VARIABLE] = OPTIONS[option][0]
                start = time.perf_counter()
                for shape in shapes:
                    linear(inputs[n][shape], matrices[option, shape])
                if round_index:
                    seconds[option, n].append(time.perf_counter() - start)
    print(f"{'option':18} {'rows':>6} {'layer ms':>9} {'GFLOP/s':>8}")
    for n in row_counts:
        flops = sum(2 * n * num_in * num_out for num_in, num_out in shapes)
        for option in options:
            median = statistics.median(seconds[option, n])
            print(f"{option:18} {n:6} {median * 1e3:9.2f} {flops / median / 1e9:8.0f}")


def decode_layouts(shapes, rounds: int) -> None:
    """One row through the native product, bf16 packed against plain [in, out], from memory."""
    torch.manual_seed(0)
    print(f"\n{'decode, 1 row':18} {'shape':>12} {'packed ms':>10} {'[in, out] ms':>13}")
    for num_in, num_out in sorted(set(shapes)):
        weight = torch.randn(num_in, num_out).bfloat16()
        copies = max(2, FROM_MEMORY_BYTES // weight.nbytes // 2)
        layouts = {
            "packed": [native_matrix(pack_matrix(weight), None) for _ in range(copies)],
            "plain": [native_matrix(weight.clone(), None) for _ in range(copies)],
        }
        x = torch.randn(1, num_in)
        times = {name: [] for name in layouts}
        for _ in range(rounds):
            for name, products in layouts.items():
                start = time.perf_counter()
                for product in products:
                    product(x)
                times[name].append((time.perf_counter() - start) / copies)
        packed, plain = (statistics.median(times[name]) * 1e3 for name in layouts)
        print(f"{'':18} {num_in:5}x{num_out:<6} {packed:10.3f} {plain:13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="lm180m", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="512,4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    parser.add_argument("--decode", action="store_true", help="also time the layouts in decode")
    args = parser.parse_args()
    flags = cpu_flags()
    options = []
    for option in args.options.split(","):
        needed = OPTIONS[option][0]
        if needed and needed not in flags:
            print(f"{option}: skipped (no {needed} in this CPU's flags)")
        else:
            options.append(option)
    shapes = projection_shapes(args.preset)
    row_counts = [int(n) for n in args.rows.split(",")]
    torch.set_num_threads(args.threads or torch.get_num_threads())
    threads = torch.get_num_threads()
    print(f"{args.preset}: shapes {shapes}, {threads} threads, {args.rounds} rounds")
    prefill_options(shapes, row_counts, args.rounds, options)
    if args.decode:
        decode_layouts(shapes, args.rounds)


if __name__ == "__main__":
    main()
