"""The arithmetic of long products: which dtype prefill batches and the vision tower compute in.

`--dtype` is how weights are stored; the compute dtype (`EngineConfig.compute_dtype`) is the
arithmetic of what is bound by it rather than by reading weights: prefill's long batches and
the vision tower. On CPU, "auto" picks bfloat16 for bfloat16 weights where the CPU's flags show
bfloat16 dot products (avx512_bf16 or amx_bf16), else float32 (on CUDA everything computes in
the weights' dtype, `WeightFormat.resolved`: bfloat16 for bfloat16 weights). The
CPU's flags are read at run time (`kernels.cpu_flags`), never assumed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stillcut.kernels.cpu_flags import BF16_FLAGS, cpu_flags

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Arithmetic(NamedTuple):
    """The dtype long products compute in, and why (what /health and `inspect` say)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def to_dict(self) -> dict[str, str]:
        """As /health and `inspect --json` report it."""
        return {"dtype": self.name, "reason": self.reason}


def resolve_arithmetic(name: str, stored: torch.dtype, quantization: str | None) -> Arithmetic:
    """The CPU arithmetic `EngineConfig.compute_dtype` `name` asks for, with weights stored
    as `stored` (matrices quantized by `quantization`: those keep their own products, and
    "auto" keeps float32 for the rest)."""
    if name != "auto":
        return Arithmetic(COMPUTE_DTYPES[name], "set by compute_dtype")
    if quantization is not None:
        return Arithmetic(torch.float32, f"auto: {quantization} matrices, float32 elsewhere")
    if stored != torch.bfloat16:
        stored_name = str(stored).removeprefix("torch.")
        return Arithmetic(torch.float32, f"auto: weights stored in {stored_name}, not bfloat16")
    found = sorted(cpu_flags().intersection(BF16_FLAGS))
    if found:
        return Arithmetic(torch.bfloat16, f"auto: bfloat16 weights, CPU has {' '.join(found)}")
    return Arithmetic(torch.float32, f"auto: CPU has none of {' '.join(BF16_FLAGS)}")


def salted(cache_salt: str | None, arithmetic: Arithmetic) -> str:
    """A request's prefix-cache salt with the arithmetic its KV was computed in: blocks
    prefilled in bfloat16 are never reused as float32 ones (or the other way)."""
    own = f"compute={arithmetic.name}"
    return own if cache_salt is None else f"{own}\0{cache_salt}"
