"""Long-batch products on CPU in the CPU's dot-product arithmetic (`gemm.c`).

A prefill's products are bound by arithmetic, not by reading weights. torch's bfloat16 GEMM is
fast here, but a weight the decode step stores packed (`packing.pack_matrix`) had to
be copied unpacked for every product, and the rows rounded to bfloat16 and the sums widened
back in passes of their own; torch's int8 `_int_mm` on CPU is slower than its float32 GEMM.
The native products read the decode step's layouts as they are (packed bfloat16 tiles, int8
quad panels), take float32 rows and give float32 sums:

  bf16_product   rows rounded to bfloat16, bf16 x bf16 products, float32 sums
  w8a8_product   rows quantized per token (`engine.models.w8a8`'s rule), exact int32 sums,
                 scaled by both scales
  int8_sums      the integer sums alone, of rows already quantized

Which dot products run follows the CPU's flags (`cpu_flags`: /proc/cpuinfo,
or `STILLCUT_CPU_FLAGS`): AMX tiles where `amx_bf16` / `amx_int8`, else AVX-512 where
`avx512_bf16` / `avx512_vnni`, as far as this build and the OS allow (`isas`); elsewhere the
functions return None and the caller keeps torch's products. The library is compiled like the
decode step's (`library.compiled`) and off with it (`STILLCUT_NATIVE_DECODE=0`).
"""

from __future__ import annotations

import ctypes
import functools
from enum import IntEnum
from pathlib import Path

import torch

from stillcut.kernels.cpu.library import compiled, enabled
from stillcut.kernels.cpu.packing import is_packed, is_quads, matrix_shape
from stillcut.kernels.cpu_flags import cpu_flags

SOURCE = Path(__file__).with_suffix(".c")


class Isa(IntEnum):
    """How the dot products are taken (`enum isa` in the C file)."""

    VECTOR = 1  # AVX-512: vdpbf16ps, vpdpbusd
    TILES = 2  # AMX: tdpbf16ps, tdpbssd


# (product, isa) -> its bit in `gemm_isas` and the CPU flag it needs
FEATURES = {
    ("bf16", Isa.VECTOR): (0, "avx512_bf16"),
    ("bf16", Isa.TILES): (1, "amx_bf16"),
    ("int8", Isa.VECTOR): (2, "avx512_vnni"),
    ("int8", Isa.TILES): (3, "amx_int8"),
}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be built or native code is off."""
    if not enabled():
        return None
    library = compiled(SOURCE, (), "the native CPU prefill products", "about 5 s")
    if library is None:
        return None
    address, int32, int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    rows = [address, int64, int32]  # x, its stride, rows
    out = [address, int64, address, int32, int32]  # add, its stride, y, isa, threads
    library.gemm_bf16.argtypes = [address, int32, int32, *rows, *out]
    library.gemm_w8a8.argtypes = [address, address, int32, int32, *rows, *out]
    library.int8_sums.argtypes = [address, int32, int32, *rows, address, int32, int32]
    return library


@functools.cache
def isas() -> frozenset[tuple[str, Isa]]:
    """The (product, isa) pairs this build can run in this process (AMX where the OS grants
    its tiles), whatever the flags say."""
    library = load()
    if library is None:
        return frozenset()
    found = library.gemm_isas()
    return frozenset(key for key, (bit, _) in FEATURES.items() if found >> bit & 1)


def chosen_isa(product: str) -> Isa | None:
    """The fastest way to take `product`'s ("bf16" or "int8") dot products that both the
    CPU's flags and this build allow: tiles before vectors; None for neither."""
    flags = cpu_flags()
    for isa in (Isa.TILES, Isa.VECTOR):
        if FEATURES[product, isa][1] in flags and (product, isa) in isas():
            return isa
    return None


def bf16_product(
    x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None, isa: Isa | None = None
) -> torch.Tensor | None:
    """float32 `x` `[N, in]` @ a packed bfloat16 `weight` (`pack_matrix`) in bf16 products
    with float32 sums, plus `add` (a bias `[out]` or rows `[N, out]`): float32 `[N, out]`;
    None where it cannot run (no `isa`, by default `chosen_isa("bf16")`; another layout)."""
    isa = chosen_isa("bf16") if isa is None else isa
    if isa is None or weight.dtype != torch.bfloat16 or not _reads(x, weight):
        return None
    return _run("gemm_bf16", (weight.data_ptr(),), x, weight, add, isa)


def w8a8_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    add: torch.Tensor | None = None,
    isa: Isa | None = None,
) -> torch.Tensor | None:
    """float32 `x` `[N, in]` quantized per row @ an int8 `weight` as quad panels
    (`pack_quads`) with its per-column `scale`, in exact integer sums times both scales, plus
    `add`: float32 `[N, out]`; None where it cannot run (as `bf16_product`)."""
    isa = chosen_isa("int8") if isa is None else isa
    if isa is None or not is_quads(weight) or not _reads(x, weight):
        return None
    scale = scale.float().contiguous()
    return _run("gemm_w8a8", (weight.data_ptr(), scale.data_ptr()), x, weight, add, isa)


def int8_sums(
    values: torch.Tensor, weight: torch.Tensor, isa: Isa | None = None
) -> torch.Tensor | None:
    """int8 `values` `[N, in]` @ an int8 `weight` as quad panels: their exact int32 sums
    `[N, out]`; None where it cannot run (as `bf16_product`)."""
    isa = chosen_isa("int8") if isa is None else isa
    if isa is None or not is_quads(weight) or values.dtype != torch.int8:
        return None
    values = values if values.stride(-1) == 1 else values.contiguous()
    num_in, num_out = matrix_shape(weight)
    sums = torch.empty(values.shape[0], num_out, dtype=torch.int32)
    status = load().int8_sums(
        weight.data_ptr(),
        num_in,
        num_out,
        values.data_ptr(),
        values.stride(0),
        values.shape[0],
        sums.data_ptr(),
        isa,
        torch.get_num_threads(),
    )
    return None if status else sums


def _reads(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the native products take `x` and `weight`: float32 rows on CPU and a matrix in
    the decode step's packed layouts."""
    return x.dtype == torch.float32 and x.dim() == 2 and x.is_cpu and weight.dim() == 4


def _run(name: str, weight_args: tuple[int, ...], x, weight, add, isa: Isa) -> torch.Tensor | None:
    if not is_packed(weight):
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    num_in, num_out = matrix_shape(weight)
    add_address, add_stride = 0, 0
    if add is not None:
        add = add.float()
        add = add if add.stride(-1) == 1 else add.contiguous()
        add_address, add_stride = add.data_ptr(), (0 if add.dim() == 1 else add.stride(0))
    out = torch.empty(x.shape[0], num_out)
    status = getattr(load(), name)(
        *weight_args,
        num_in,
        num_out,
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        add_address or None,
        add_stride,
        out.data_ptr(),
        isa,
        torch.get_num_threads(),
    )
    return None if status else out
