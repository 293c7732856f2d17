"""What the native CPU decode step reads: a model as a stack of residual blocks, each of a kind.

Every block is `hidden += [out_norm](mixer(norm(hidden)))`: an RMSNorm in, one mixer, and an
optional RMSNorm on what it adds (Gemma's sandwich norms). The mixer's type is the block's kind;
the kernel dispatches on it and never on a model family. A decoder layer of Qwen2 or Gemma 3 is
two blocks, `Attention` then `GatedMlp`; a hybrid whose layers are one mixer each is one block
per layer. A new kind is a mixer class here (with its `kind`), its struct and converter in
`cpu_decode`, and its case in `cpu_decode.c`. Weights are `[in, out]` in shape and in a stored
format (`FORMATS`): float32 in either memory order (see `engine.models.layers.matmul_layout`),
bfloat16, float16 or int8 as a contiguous `[in, out]`; an int8 weight `<name>_weight` comes with
`<name>_scale`, its float32 scale per output column `[out]`. Norms (the scales they multiply
by), biases and rotary tables are float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch

MAX_TABLES = 2  # rotary tables per model (Gemma 3: local and global), `MAX_TABLES` in C
# The stored formats of weights: dtype -> `enum format` in the C files.
FORMATS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int8: 4}


class Kind(IntEnum):
    """A block's mixer (`enum kind` in the C file)."""

    ATTENTION = 1
    GATED_MLP = 2


class Activation(IntEnum):
    """An MLP's nonlinearity (`enum activation` in the C file)."""

    SILU = 1
    GELU_TANH = 2


def _check_shape(name: str, tensor: torch.Tensor | None, *shape: int) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def _check_weight(name: str, weight: torch.Tensor, scale: torch.Tensor | None, axis: int) -> None:
    """A scale per output channel (`weight.shape[axis]`) exactly when the weight is int8. (A
    weight in a format the kernel does not read is no error here: `cpu_decode.bind` declines
    it, and the model runs its torch ops.)"""
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError(f"{name}: an int8 weight needs a scale, and only an int8 weight has one")
    _check_shape(f"{name} scale", scale, weight.shape[axis])


@dataclass(frozen=True, eq=False)
class Attention:
    """GQA attention over the paged KV cache `cache`, an index into the step's KV caches (the
    runner's: one per attention layer, in layer order, see `engine.cache_groups`): fused q|k|v
    projection (+ `qkv_bias`), an RMSNorm per q and k head (`qk_norm`, optional),
    rotary table `table`, scores times `scale` (soft-capped by `soft_cap` when > 0), keys
    within `window` positions (0: all), output projection."""

    kind: ClassVar[Kind] = Kind.ATTENTION
    qkv_weight: torch.Tensor  # [hidden, (Hq + 2 Hkv) * D]: q, k, v columns
    o_weight: torch.Tensor  # [Hq * D, hidden]
    num_heads: int
    num_kv_heads: int
    cache: int
    scale: float
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D]
    qk_norm: torch.Tensor | None = None  # [Hq + Hkv, D]: per q head, then per k head
    window: int = 0
    table: int = 0
    soft_cap: float = 0.0
    qkv_scale: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D]: an int8 qkv_weight's
    o_scale: torch.Tensor | None = None  # [hidden]: an int8 o_weight's

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} >= 1"
            )
        for name in ("cache", "window", "table"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        width = (self.num_qk_heads + self.num_kv_heads) * self.head_dim
        _check_shape("o_weight", self.o_weight, self.num_heads * self.head_dim, self.hidden)
        _check_shape("qkv_weight", self.qkv_weight, self.hidden, width)
        _check_shape("qkv_bias", self.qkv_bias, width)
        _check_shape("qk_norm", self.qk_norm, self.num_qk_heads, self.head_dim)
        _check_weight("qkv_weight", self.qkv_weight, self.qkv_scale, 1)
        _check_weight("o_weight", self.o_weight, self.o_scale, 1)

    @property
    def hidden(self) -> int:
        return self.qkv_weight.shape[0]

    @property
    def head_dim(self) -> int:
        return self.o_weight.shape[0] // self.num_heads

    @property
    def num_qk_heads(self) -> int:
        return self.num_heads + self.num_kv_heads


@dataclass(frozen=True, eq=False)
class GatedMlp:
    """`(act(x @ W_gate) * (x @ W_up)) @ W_down`, gate and up fused side by side."""

    kind: ClassVar[Kind] = Kind.GATED_MLP
    gate_up_weight: torch.Tensor  # [hidden, 2 * intermediate]: gate, up columns
    down_weight: torch.Tensor  # [intermediate, hidden]
    activation: Activation
    gate_up_scale: torch.Tensor | None = None  # [2 * intermediate]: an int8 gate_up_weight's
    down_scale: torch.Tensor | None = None  # [hidden]: an int8 down_weight's

    def __post_init__(self) -> None:
        intermediate = self.down_weight.shape[0]
        _check_shape("gate_up_weight", self.gate_up_weight, self.hidden, 2 * intermediate)
        _check_weight("gate_up_weight", self.gate_up_weight, self.gate_up_scale, 1)
        _check_weight("down_weight", self.down_weight, self.down_scale, 1)
        Activation(self.activation)  # a ValueError names a value that is none

    @property
    def hidden(self) -> int:
        return self.down_weight.shape[1]


Mixer = Attention | GatedMlp


@dataclass(frozen=True, eq=False)
class Block:
    """One residual block: `hidden += [out_norm](mixer(norm(hidden)))`."""

    norm: torch.Tensor  # [hidden]
    mixer: Mixer
    out_norm: torch.Tensor | None = None  # [hidden]; None: the mixer's output is added as is

    def __post_init__(self) -> None:
        _check_shape("out_norm", self.out_norm, *self.norm.shape)


@dataclass(frozen=True, eq=False)
class Stack:
    """A decoder from token ids to its final norm: the embedding `[vocab, hidden]` (any
    strides: a tied model's is the head's transpose; int8 with `embedding_scales` `[vocab]`, a
    scale per row) times `embedding_scale`, the `blocks`, the final norm. `inv_freqs` are the
    rotary tables' frequencies `[D/2]` and `section` `[D/2]` the position row each frequency
    turns with (M-RoPE; zeros for 1-D positions). Every RMSNorm divides by
    sqrt(mean(x^2) + `eps`)."""

    blocks: Sequence[Block]
    embedding: torch.Tensor
    final_norm: torch.Tensor  # [hidden]
    inv_freqs: Sequence[torch.Tensor]
    section: torch.Tensor
    eps: float
    embedding_scale: float = 1.0
    embedding_scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not 1 <= len(self.inv_freqs) <= MAX_TABLES:
            raise ValueError(f"{len(self.inv_freqs)} rotary tables; 1 to {MAX_TABLES} allowed")
        half = self.section.shape[0]
        hidden = self.final_norm.shape[0]
        _check_shape("embedding", self.embedding, self.embedding.shape[0], hidden)
        _check_weight("embedding", self.embedding, self.embedding_scales, 0)
        for table, inv_freq in enumerate(self.inv_freqs):
            _check_shape(f"inv_freqs[{table}]", inv_freq, half)
        for index, block in enumerate(self.blocks):
            mixer = block.mixer
            _check_shape(f"blocks[{index}].norm", block.norm, hidden)
            if mixer.hidden != hidden:
                raise ValueError(f"blocks[{index}] is {mixer.hidden} wide, the stack {hidden}")
            if isinstance(mixer, Attention) and mixer.head_dim != 2 * half:
                raise ValueError(
                    f"blocks[{index}] head_dim {mixer.head_dim} is not the rotary {2 * half}"
                )
            if isinstance(mixer, Attention) and mixer.table >= len(self.inv_freqs):
                raise ValueError(
                    f"blocks[{index}] rotary table {mixer.table} of {len(self.inv_freqs)}"
                )

    @property
    def hidden(self) -> int:
        return self.final_norm.shape[0]
