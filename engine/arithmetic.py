"""The arithmetic of long products: which dtype prefill batches and the vision tower compute in.

`--dtype` is how weights are stored; the compute dtype (`EngineConfig.compute_dtype`) is the
arithmetic of what is bound by it rather than by reading weights: prefill's long batches and
the vision tower. On CPU, "auto" picks bfloat16 for bfloat16 weights where the CPU's flags show
bfloat16 dot products (avx512_bf16 or amx_bf16), else float32 (on CUDA everything computes in
the weights' dtype, `WeightFormat.resolved`: bfloat16 for bfloat16 weights). The
CPU's flags are read at run time from /proc/cpuinfo, never assumed; `STILLCUT_CPU_FLAGS`
replaces them (space-separated; empty: none), so the detection can be forced off.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FLAGS_VARIABLE = "STILLCUT_CPU_FLAGS"


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


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: `STILLCUT_CPU_FLAGS` when set, else /proc/cpuinfo's (none
    where there is no such file)."""
    forced = os.environ.get(FLAGS_VARIABLE)
    if forced is not None:
        return frozenset(forced.split())
    return _proc_cpu_flags()


@functools.cache
def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


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
