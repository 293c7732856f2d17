"""Weights as stored: the format each checkpoint tensor is kept in, and int8 quantization.

A `WeightFormat` says how a model's weights live in memory: floating tensors in `dtype`
(None: the checkpoint's own), the matrices a model multiplies by optionally quantized to int8,
the dtype activations are computed in (float32 on CPU, whatever the weights; the weights'
dtype on CUDA), and the arithmetic of long products (prefill batches, the vision tower:
`engine.arithmetic`). On CPU only the matrices stay narrow — products widen them in registers
(`kernels/cpu/formats.h`) — while norms, biases, position tables and the like, a small share of
the bytes, are rounded to `dtype` and kept in the compute dtype, so the model computes exactly
what an fp32 model with every tensor rounded to `dtype` computes.

int8 is weight-only and symmetric with one float32 scale per output channel, whatever the
layout: `scale = max|w| / 127` over the channel, `q = round_half_even(w / scale)` clipped to
±127 (a zero channel has scale 0 and q 0), and `w ≈ q * scale`. `plan_formats` decides which
tensors it covers: every matrix of a product (`nn.Linear` weights, patch-embedding convolutions
as `[out, in * kernel]`) plus the ones a model names (token embeddings, bare projection
parameters), each with the axis of its output channels; a stack of experts' matrices is
quantized matrix by matrix, a scale per expert and output channel. `lm_head` in `skip` keeps
the LM head (and a tied table, which is the head) in `dtype`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn

from stillcut.engine.arithmetic import Arithmetic, resolve_arithmetic

QUANTIZATIONS = ("int8", "w8a8")
SKIPPABLE = ("lm_head",)
INT8_MAX = 127
# Tensors are converted a block of rows at a time, at most this many float32 bytes of them:
# quantizing one holds a few such temporaries, a small share of a model that needs blocks.
BLOCK_BYTES = 16 << 20
STORED_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class WeightFormat:
    """How a model's weights are stored (see the module docstring). `dtype` None means the
    checkpoint's own, `compute_dtype` None the stored dtype (CUDA's way): `resolved` sets
    both; `skip` names parts left unquantized. `compute` is `EngineConfig.compute_dtype`, the
    arithmetic of long products (prefill batches, the vision tower; see `engine.arithmetic`),
    which `resolved` settles as `arithmetic` for `device`."""

    dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = torch.float32
    quantization: str | None = None
    skip: tuple[str, ...] = ()
    compute: str = "float32"
    device: str = "cpu"
    arithmetic: Arithmetic | None = None

    @classmethod
    def for_engine(
        cls,
        dtype: str,
        quantization: str | None,
        skip: tuple[str, ...],
        device: str,
        compute: str = "float32",
    ) -> WeightFormat:
        """The format `EngineConfig`'s fields ask for: on CPU activations are float32, and
        long products compute in `compute`."""
        stored = None if dtype == "auto" else STORED_DTYPES[dtype]
        activations = torch.float32 if torch.device(device).type == "cpu" else None
        return cls(stored, activations, quantization, tuple(skip), compute, device)

    def __post_init__(self) -> None:
        allowed = tuple(STORED_DTYPES.values())
        if self.dtype is not None and self.dtype not in allowed:
            raise ValueError(f"dtype={self.dtype} must be None or one of {allowed}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={self.quantization!r}: allowed None, {QUANTIZATIONS}")
        unknown = set(self.skip) - set(SKIPPABLE)
        if unknown:
            raise ValueError(f"skip={self.skip}: unknown {sorted(unknown)}; allowed {SKIPPABLE}")

    def resolved(self, checkpoint_dtype: torch.dtype) -> WeightFormat:
        """This format with `dtype` (`checkpoint_dtype`, the checkpoint's own, when None),
        `compute_dtype` (the stored one when None) and `arithmetic` set."""
        dtype = self.dtype if self.dtype is not None else checkpoint_dtype
        compute_dtype = self.compute_dtype or dtype
        arithmetic = self.arithmetic
        if arithmetic is None and torch.device(self.device).type != "cpu":
            arithmetic = Arithmetic(compute_dtype, f"{self.device} computes in the weights' dtype")
        arithmetic = arithmetic or resolve_arithmetic(self.compute, dtype, self.quantization)
        return replace(self, dtype=dtype, compute_dtype=compute_dtype, arithmetic=arithmetic)

    @property
    def product_dtype(self) -> torch.dtype:
        """The dtype long products compute in (a resolved format's `arithmetic`)."""
        assert self.arithmetic is not None, "resolve the format against its checkpoint first"
        return self.arithmetic.dtype

    @property
    def matrix_dtype(self) -> torch.dtype:
        """The dtype a long batch's matrix products compute in: int8 under "w8a8" (rows
        quantized per token, `models.w8a8`), else `product_dtype`."""
        return torch.int8 if self.quantization == "w8a8" else self.product_dtype

    def for_tower(self) -> WeightFormat:
        """This resolved format as a vision tower computes: everything in its arithmetic."""
        return replace(self, compute_dtype=self.product_dtype)

    def kv_cache_dtype(self, name: str) -> torch.dtype:
        """The K/V pool's dtype for `EngineConfig.kv_cache_dtype` `name` ("auto": the compute
        dtype, float32 on CPU) of a resolved format."""
        return self.compute_dtype if name == "auto" else STORED_DTYPES[name]

    def embedding_key(self) -> str:
        """What of a resolved format shapes a tower's embeddings: the stored format and the
        arithmetic (part of the encoder cache's key)."""
        return f"{self.describe()}; arithmetic {self.arithmetic.name}"

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
    `axis`), rounded through `through` first when set (a vector rounded to the stored dtype,
    kept in the compute dtype); `head`: an LM head table `[vocab, hidden]`, laid out at load as
    `layers.head_layout` keeps it (panels on CPU where the vocabulary is whole panels, int8
    quad panels where they fit, else the `[rows, cols]` view of a contiguous `[cols, rows]`);
    `stacked`: the tensor is a stack of matrices `[E, ...]` (experts), each quantized on its
    own, a scale per matrix and output channel (`[E, shape[axis]]`)."""

    dtype: torch.dtype
    axis: int | None = None
    through: torch.dtype | None = None
    head: bool = False
    stacked: bool = False


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
    heads: Collection[str] = (),
    stacks: Collection[str] = (),
) -> dict[str, Conversion]:
    """A `Conversion` for every state tensor of `module` (a checkpoint-named layout): the
    `matmuls` (name -> output axis, see `matmul_weights`) in the stored dtype or int8 (but for
    `unquantized`), the `heads` laid out as LM heads, the `stacks` (of `matmuls`: stacked
    experts) quantized matrix by matrix; everything else rounded to the stored dtype and kept
    in the compute dtype."""
    stored, compute = weight_format.stored_dtype, weight_format.compute_dtype
    assert compute is not None, "resolve the format against its checkpoint first"
    plan = {}
    for name in module.state_dict(keep_vars=True):
        if name not in matmuls:
            plan[name] = Conversion(compute, through=stored if stored != compute else None)
            continue
        quantized = weight_format.quantizes() and name not in unquantized
        plan[name] = Conversion(
            torch.int8 if quantized else stored,
            matmuls[name] if quantized else None,
            head=name in heads,
            stacked=name in stacks,
        )
    return plan


def quantize_int8(weight: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` as int8 per output channel along `axis`, and the float32 scales of the
    channels (`weight.shape[axis]`): see the module docstring. Besides the result it holds one
    float32 copy of `weight` (a block of a large tensor's rows at load)."""
    values = weight.to(torch.float32, copy=True)
    channels = values.movedim(axis, 0)
    low, high = channels.reshape(channels.shape[0], -1).aminmax(dim=1)
    scale = torch.maximum(-low, high) / INT8_MAX
    shape = [1] * values.dim()
    shape[axis] = -1
    ratio = values.div_(scale.view(shape)).nan_to_num_(nan=0.0)  # 0 / 0 in a zero channel: q = 0
    return ratio.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_stack(stack: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack of matrices `[E, ...]` as int8, each quantized on its own per output channel
    along `axis` of the stack (`quantize_int8`), and the scales `[E, stack.shape[axis]]`."""
    parts = [quantize_int8(matrix, axis - 1) for matrix in stack]
    return torch.stack([q for q, _ in parts]), torch.stack([scale for _, scale in parts])


def row_blocks(num_rows: int, row_elements: int, unit: int = 1) -> Iterator[slice]:
    """Slices of rows that hold at most `BLOCK_BYTES` of float32 each (at least `unit` rows;
    whole multiples of `unit` but the last)."""
    step = max(1, BLOCK_BYTES // (4 * max(row_elements, 1) * unit)) * unit
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


def widened(module: nn.Module, name: str = "weight", axis: int = 0) -> torch.Tensor:
    """`module.<name>` (and its int8 `<name>_scale`) in the dtype it computes in: the
    module's `compute_dtype` where its loader set one (a vision tower's arithmetic), else
    float32 on CPU and the weight's own dtype elsewhere; `axis` is its output channels' (see
    `dense`)."""
    weight = getattr(module, name)
    dtype = torch.float32 if weight.is_cpu else weight.dtype
    dtype = getattr(module, "compute_dtype", dtype)
    return dense(weight, getattr(module, f"{name}_scale", None), axis, dtype)


def stored_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of `module` as stored (int8 scales included)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
