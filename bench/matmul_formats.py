"""The native product `x @ W` with W stored as float32, bfloat16, float16 and int8 (per-column
scales), against each format's read floor: the microkernel measurement behind `kernels/cpu/band.h`.

Widening a narrow weight in registers costs instructions that compete with the FMAs for the
same ports (int8: a sign extension and a conversion per 8 values), so a narrow format reads
fewer bytes but may not reach its own floor. Each round times, back to back, every format's
product at 1 and at 8 rows and one read of a buffer as large as the float32 weight (a sum:
one streaming pass); a product's floor is its weight's bytes over the bandwidth of that read.
The table gives medians over rounds of the time, of the time over its floor, and of the speed
relative to float32 at the same row count. The float32 weight is read by the same kernel, as a
contiguous [in, out] (the layout the narrow formats use).

A weight of a few MB stays in the caches when one product is timed over and over, while in a
decode step it comes from memory (the other layers' weights have streamed through the caches
since). `--from-memory` times each product over copies of its weight that together outgrow
any cache (`FROM_MEMORY_BYTES` of float32), one after another, and reads a buffer as large as
the float32 copies for the floor: the measurement behind `NARROW_COLUMNS` in `kernels/cpu/band.h`.
Each product is one call from Python here (tens of microseconds of its own, which a decode
step's products do not pay), so for weights of 1-2 MB compare formats and builds, not floors.

    python bench/matmul_formats.py [--shape 2048x11008] [--rounds 15] [--threads 2]
        [--from-memory]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stillcut.engine.quantization import quantize_int8
from stillcut.kernels.cpu import decoder

ROWS = (1, 8)
FROM_MEMORY_BYTES = 256 << 20  # float32 copies of the weight for --from-memory: past any L3


def stored(weight: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    quantized, scale = quantize_int8(weight, 1)
    return {
        "float32": (weight, None),
        "bfloat16": (weight.to(torch.bfloat16), None),
        "float16": (weight.to(torch.float16), None),
        "int8": (quantized.contiguous(), scale),
    }


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="2048x11008", help="in x out of the weight")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--from-memory", action="store_true", help="time products over copies past the caches"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_in, num_out = map(int, args.shape.split("x"))
    num_copies = -(-FROM_MEMORY_BYTES // (4 * num_in * num_out)) if args.from_memory else 1
    generator = torch.Generator().manual_seed(0)
    copies = [stored(torch.randn(num_in, num_out, generator=generator)) for _ in range(num_copies)]
    products = {}  # format -> (its product with each copy, the bytes of one)
    for name, (tensor, scale) in copies[0].items():
        natives = [decoder.native_matrix(*copy[name]) for copy in copies]
        if None in natives:
            raise SystemExit("the native kernel did not build here")
        scale_bytes = 0 if scale is None else 4 * scale.numel()
        products[name] = (natives, tensor.numel() * tensor.element_size() + scale_bytes)
    inputs = {rows: torch.randn(rows, num_in) for rows in ROWS}
    buffer = torch.ones(num_copies * num_in * num_out)
    times = {(name, rows): [] for name in products for rows in ROWS}
    reads = []
    for _ in range(args.rounds):
        for (name, rows), record in times.items():
            natives, x = products[name][0], inputs[rows]
            elapsed = seconds(lambda: [native(x) for native in natives])  # noqa: B023
            record.append(elapsed / num_copies)
        reads.append(seconds(buffer.sum) / num_copies)
    bandwidth = num_in * num_out * 4 / statistics.median(reads)
    source = f", each product over {num_copies} copies" if args.from_memory else ""
    print(
        f"W [{num_in}, {num_out}], {args.threads} thread(s), {args.rounds} rounds{source}, "
        f"read {bandwidth / 1e9:.1f} GB/s"
    )
    print(f"{'format':<10}{'rows':>5}{'ms':>9}{'floor ms':>10}{'/floor':>8}{'vs f32':>8}")
    for (name, rows), record in times.items():
        median = statistics.median(record)
        floor = products[name][1] / bandwidth
        versus = statistics.median(times["float32", rows]) / median
        print(
            f"{name:<10}{rows:>5}{median * 1e3:>9.2f}{floor * 1e3:>10.2f}"
            f"{median / floor:>8.2f}{versus:>7.2f}x"
        )


if __name__ == "__main__":
    main()
