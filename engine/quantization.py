"""Weights as stored: the format each checkpoint tensor is kept in, and int8 quantization.

A `WeightFormat` says how a model's weights live in memory: floating tensors in `dtype`
(None: the checkpoint's own), the matrices a model multiplies by optionally quantized to int8,
and the dtype activations are computed in (float32 on CPU, whatever the weights; the weights'
dtype on CUDA). On CPU only the matrices stay narrow — products widen them in registers
(`kernels/cpu_linear.h`) — while norms, biases, position tables and the like, a small share of
the bytes, are rounded to `dtype` and kept in the compute dtype, so the model computes exactly
what an fp32 model with every tensor rounded to `dtype` computes.

int8 is weight-only and symmetric with one float32 scale per output channel, whatever the
layout: `scale = max|w| / 127` over the channel, `q = round_half_even(w / scale)` clipped to
±127 (a zero channel has scale 0 and q 0), and `w ≈ q * scale`. `plan_formats` decides which
tensors it covers: every matrix of a product (`nn.Linear` weights, patch-embedding convolutions
as `[out, in * kernel]`) plus the ones a model names (token embeddings, bare projection
parameters), each with the axis of its output channels. `lm_head` in `skip` keeps the LM head
(and a tied table, which is the head) in `dtype`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

QUANTIZATIONS = ("int8",)
SKIPPABLE = ("lm_head",)
INT8_MAX = 127
# Tensors are converted a block of rows at a time, at most this many float32 bytes of them.
BLOCK_BYTES = 64 << 20
STORED_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class WeightFormat:
    """How a model's weights are stored (see the module docstring). `dtype` None means the
    checkpoint's own (`resolved` reads it); `skip` names parts left unquantized."""

    dtype: torch.dtype | None = None
    compute_dtype: torch.dtype = torch.float32
    quantization: str | None = None
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        allowed = tuple(STORED_DTYPES.values())
        if self.dtype is not None and self.dtype not in allowed:
            raise ValueError(f"dtype={self.dtype} must be None or one of {allowed}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={self.quantization!r}: allowed None, {QUANTIZATIONS}")
        unknown = set(self.skip) - set(SKIPPABLE)
        if unknown:
            raise ValueError(f"skip={self.skip}: unknown {sorted(unknown)}; allowed {SKIPPABLE}")

    def resolved(self, folder: str | Path) -> WeightFormat:
        """This format with `dtype` set: the checkpoint's own when it is None."""
        if self.dtype is not None:
            return self
        return replace(self, dtype=checkpoint_dtype(folder))

    def quantizes(self, part: str | None = None) -> bool:
        """Whether matrices (of `part`, e.g. "lm_head") are quantized."""
        return self.quantization is not None and part not in self.skip

    @property
    def stored_dtype(self) -> torch.dtype:
        assert self.dtype is not None, "resolve the format against its checkpoint first"
        return self.dtype

    def describe(self) -> str:
        """What the startup log and /health say: e.g. "bfloat16", "int8 (bfloat16, lm_head)"."""
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "auto"
        if self.quantization is None:
            return dtype
        return f"{self.quantization} ({', '.join((dtype, *(f'{s} kept' for s in self.skip)))})"


class Conversion(NamedTuple):
    """What one checkpoint tensor becomes at load: `dtype` (int8: quantized per channel along
    `axis`), after rounding through `through` when that differs (a vector rounded to the stored
    dtype, kept in the compute dtype)."""

    dtype: torch.dtype
    axis: int | None = None
    through: torch.dtype | None = None


def checkpoint_dtype(folder: str | Path) -> torch.dtype:
    """The dtype a checkpoint says it is stored in (config.json `dtype` / `torch_dtype`), else
    the dtype of its first floating tensor."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        name = section.get("dtype") or section.get("torch_dtype")
        if name in STORED_DTYPES:
            return STORED_DTYPES[name]
    from stillcut.engine.loader import stored_floating_dtype

    return stored_floating_dtype(folder)


def matmul_weights(module: nn.Module, extra: Mapping[str, int] = {}) -> dict[str, int]:
    """State name -> output-channel axis of every matrix `module` multiplies by: `nn.Linear`
    weights and 2-D/3-D convolutions (patch embeddings; a Mamba depthwise `Conv1d` is no
    matrix), plus `extra` (a model's token embedding, bare projection parameters)."""
    found = {
        f"{name}.weight" if name else "weight": 0
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear | nn.Conv2d | nn.Conv3d)
    }
    return {**found, **extra}


def plan_formats(
    module: nn.Module,
    weight_format: WeightFormat,
    matmuls: Mapping[str, int],
    unquantized: Collection[str] = (),
) -> dict[str, Conversion]:
    """A `Conversion` for every state tensor of `module` (a checkpoint-named layout): the
    `matmuls` (name -> output axis, see `matmul_weights`) in the stored dtype or int8 (but for
    `unquantized`), everything else rounded to the stored dtype and kept in the compute dtype."""
    stored, compute = weight_format.stored_dtype, weight_format.compute_dtype
    plan = {}
    for name in module.state_dict(keep_vars=True):
        if name in matmuls and weight_format.quantizes() and name not in unquantized:
            plan[name] = Conversion(torch.int8, matmuls[name])
        elif name in matmuls:
            plan[name] = Conversion(stored)
        else:
            plan[name] = Conversion(compute, through=stored)
    return plan


def quantize_int8(weight: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` as int8 per output channel along `axis`, and the float32 scales of the
    channels (`weight.shape[axis]`): see the module docstring."""
    values = weight.float()
    others = tuple(d for d in range(values.dim()) if d != axis)
    scale = values.abs().amax(dim=others, keepdim=True) / INT8_MAX
    ratio = torch.div(values, scale).nan_to_num_(nan=0.0)  # 0 / 0 in a zero channel: q = 0
    return ratio.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale.flatten()


def row_blocks(num_rows: int, row_elements: int) -> Iterator[slice]:
    """Slices of rows that hold at most `BLOCK_BYTES` of float32 each (at least one row)."""
    step = max(1, BLOCK_BYTES // (4 * max(row_elements, 1)))
    for start in range(0, num_rows, step):
        yield slice(start, min(start + step, num_rows))


def dense(
    weight: torch.Tensor, scale: torch.Tensor | None, axis: int, dtype: torch.dtype
) -> torch.Tensor:
    """`weight` widened to `dtype` (times its int8 `scale` along `axis`): what a product with
    it reads, made for one layer at a time (towers' products, long prefill chunks)."""
    if scale is None:
        return weight if weight.dtype == dtype else weight.to(dtype)
    shape = [1] * weight.dim()
    shape[axis] = -1
    return weight.to(dtype) * scale.to(dtype).view(shape)
