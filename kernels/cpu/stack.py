"""What the native CPU decode step reads: a model as a stack of residual blocks, each of a kind.

Every block is `hidden += [out_norm](mixer(norm(hidden)))`: an RMSNorm in, one mixer, and an
optional RMSNorm on what it adds (sandwich norms). The mixer's type is the block's kind; the
kernel dispatches on it and never on a model family. A dense decoder layer is two blocks,
`Attention` then `GatedMlp`; a hybrid whose layers are one mixer each is one block per layer (a
hybrid's `Mamba2`, `Moe`, `Mlp` and rotary-free `Attention`; a layer's softmax-routed gated
experts, `SoftmaxMoe`, in place of its MLP; a Gated DeltaNet hybrid's `GatedDelta` and gated
`Attention`, two blocks a layer). A new kind is a mixer class here (with its `kind`), its
struct in `structs` and converter in `decoder`, and its functions in a `kinds_*.h` with its
row of `KINDS` in `decode.c`. Weights are `[in, out]` matrices in a stored format, laid out as
`packing` says. An int8 weight `<name>_weight` comes with `<name>_scale`, its float32 scale per
output column `[out]`. Norms (the scales they multiply by), biases, rotary tables, routers and
a Mamba2 block's own vectors are float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch

from stillcut.kernels.cpu.packing import PANEL_COLUMNS, is_quads, matrix_shape, panels_shape

MAX_TABLES = 2  # rotary tables per model (local and global layers may differ), `MAX_TABLES` in C


class Kind(IntEnum):
    """A block's mixer (`enum kind` in the C file)."""

    ATTENTION = 1
    GATED_MLP = 2
    MLP = 3
    MOE = 4
    MAMBA2 = 5
    SOFTMAX_MOE = 6
    GATED_DELTA = 7


class Activation(IntEnum):
    """An MLP's nonlinearity (`enum activation` in the C file)."""

    SILU = 1
    GELU_TANH = 2
    RELU2 = 3  # relu(x)²


def _check_shape(name: str, tensor: torch.Tensor | None, *shape: int) -> None:
    if tensor is not None and matrix_shape(tensor) != shape:
        raise ValueError(f"{name} has shape {matrix_shape(tensor)}, expected {shape}")


def _check_weight(name: str, weight: torch.Tensor, scale: torch.Tensor | None, axis: int) -> None:
    """A scale per output channel (`weight.shape[axis]`; per matrix of stacked `[E, in, out]`
    experts) exactly when the weight is int8. (A weight in a format the kernel does not read
    is no error here: `cpu_decode.bind` declines it, and the model runs its torch ops.)"""
    if (weight.dtype == torch.int8) != (scale is not None):
        raise ValueError(f"{name}: an int8 weight needs a scale, and only an int8 weight has one")
    shape = matrix_shape(weight)
    _check_shape(f"{name} scale", scale, *shape[:-2], shape[axis])


@dataclass(frozen=True, eq=False)
class Attention:
    """GQA attention over the paged KV cache `cache`, an index into the step's KV caches (the
    runner's: one per attention layer, in layer order, see `engine.cache_groups`): fused q|k|v
    projection (+ `qkv_bias`), an RMSNorm per q and k head (`qk_norm`, optional),
    rotary table `table` (None: no rotary embedding), scores times `scale` (soft-capped by
    `soft_cap` when > 0), keys within `window` positions (0: all), output projection. `gated`:
    `qkv_weight` has `Hq * D` more columns after v, and each head's output is times the
    sigmoid of its D of them before the projection."""

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
    table: int | None = 0
    soft_cap: float = 0.0
    qkv_scale: torch.Tensor | None = None  # [qkv columns]: an int8 qkv_weight's
    o_scale: torch.Tensor | None = None  # [hidden]: an int8 o_weight's
    gated: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} >= 1"
            )
        for name in ("cache", "window", "table"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        width = (
            self.num_qk_heads + self.num_kv_heads + self.gated * self.num_heads
        ) * self.head_dim
        _check_shape("o_weight", self.o_weight, self.num_heads * self.head_dim, self.hidden)
        _check_shape("qkv_weight", self.qkv_weight, self.hidden, width)
        _check_shape("qkv_bias", self.qkv_bias, width)
        _check_shape("qk_norm", self.qk_norm, self.num_qk_heads, self.head_dim)
        _check_weight("qkv_weight", self.qkv_weight, self.qkv_scale, 1)
        _check_weight("o_weight", self.o_weight, self.o_scale, 1)

    @property
    def hidden(self) -> int:
        return matrix_shape(self.qkv_weight)[0]

    @property
    def head_dim(self) -> int:
        return matrix_shape(self.o_weight)[0] // self.num_heads

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
        intermediate = matrix_shape(self.down_weight)[0]
        _check_shape("gate_up_weight", self.gate_up_weight, self.hidden, 2 * intermediate)
        _check_weight("gate_up_weight", self.gate_up_weight, self.gate_up_scale, 1)
        _check_weight("down_weight", self.down_weight, self.down_scale, 1)
        Activation(self.activation)  # a ValueError names a value that is none

    @property
    def hidden(self) -> int:
        return matrix_shape(self.down_weight)[1]


@dataclass(frozen=True, eq=False)
class Mlp:
    """`act(x @ W_up (+ up_bias)) @ W_down (+ down_bias)`: a plain MLP (relu² in hybrids)."""

    kind: ClassVar[Kind] = Kind.MLP
    up_weight: torch.Tensor  # [hidden, intermediate]
    down_weight: torch.Tensor  # [intermediate, out]
    activation: Activation
    up_bias: torch.Tensor | None = None  # [intermediate]
    down_bias: torch.Tensor | None = None  # [out]
    up_scale: torch.Tensor | None = None  # [intermediate]: an int8 up_weight's
    down_scale: torch.Tensor | None = None  # [out]: an int8 down_weight's

    def __post_init__(self) -> None:
        intermediate, out = matrix_shape(self.up_weight)[1], matrix_shape(self.down_weight)[1]
        _check_shape("down_weight", self.down_weight, intermediate, out)
        _check_shape("up_bias", self.up_bias, intermediate)
        _check_shape("down_bias", self.down_bias, out)
        _check_weight("up_weight", self.up_weight, self.up_scale, 1)
        _check_weight("down_weight", self.down_weight, self.down_scale, 1)
        Activation(self.activation)

    @property
    def hidden(self) -> int:
        return matrix_shape(self.up_weight)[0]


class _Routed:
    """What a mixture of experts reads off its `router` `[hidden, E]`."""

    @property
    def hidden(self) -> int:
        return self.router.shape[0]

    @property
    def num_experts(self) -> int:
        return self.router.shape[1]


@dataclass(frozen=True, eq=False)
class Moe(_Routed):
    """A mixture of experts with sigmoid routing and grouped top-k choice: `sigmoid(x @
    router)` scores; `scores + correction_bias` choose `top_k` experts among the best
    `kept_groups` of `num_groups` groups (each rated by its two best), the unbiased scores
    weight them (normalised to sum 1 when `normalize`), times `scaling`. The experts are
    bias-free MLPs with the `shared` expert's activation, on `x @ latent_in (+ bias)` when
    there is a latent projection (their weighted sum then projected by `latent_out`), else on
    x; the shared expert always sees x. Only the experts a row routes to are read."""

    kind: ClassVar[Kind] = Kind.MOE
    router: torch.Tensor  # [hidden, E] float32
    correction_bias: torch.Tensor  # [E]
    experts_up_weight: torch.Tensor  # [E, width, mid] contiguous: each expert's [in, out]
    experts_down_weight: torch.Tensor  # [E, mid, width] contiguous
    shared: Mlp
    top_k: int
    num_groups: int = 1
    kept_groups: int = 1
    normalize: bool = True
    scaling: float = 1.0
    experts_up_scale: torch.Tensor | None = None  # [E, mid]: int8 experts' scales
    experts_down_scale: torch.Tensor | None = None  # [E, width]
    latent_in_weight: torch.Tensor | None = None  # [hidden, width]
    latent_out_weight: torch.Tensor | None = None  # [width, hidden]
    latent_in_bias: torch.Tensor | None = None  # [width]
    latent_out_bias: torch.Tensor | None = None  # [hidden]
    latent_in_scale: torch.Tensor | None = None  # [width]: an int8 latent_in_weight's
    latent_out_scale: torch.Tensor | None = None  # [hidden]

    def __post_init__(self) -> None:
        num_experts, width, mid = matrix_shape(self.experts_up_weight)
        if not 1 <= self.top_k <= self.kept_groups * (num_experts // self.num_groups):
            raise ValueError(
                f"top_k={self.top_k} must be >= 1 and at most the experts of the kept groups"
            )
        if num_experts % self.num_groups or not 1 <= self.kept_groups <= self.num_groups:
            raise ValueError(
                f"num_groups={self.num_groups} must divide {num_experts} experts and be >= "
                f"kept_groups={self.kept_groups} >= 1"
            )
        if not (
            self.experts_up_weight.is_contiguous() and self.experts_down_weight.is_contiguous()
        ):
            raise ValueError("expert weights must be contiguous stacks of [in, out] matrices")
        if (self.latent_in_weight is None) != (self.latent_out_weight is None):
            raise ValueError("latent_in_weight and latent_out_weight come together")
        _check_shape("router", self.router, self.hidden, num_experts)
        _check_shape("correction_bias", self.correction_bias, num_experts)
        _check_shape("experts_down_weight", self.experts_down_weight, num_experts, mid, width)
        shared_out = matrix_shape(self.shared.down_weight)[1]
        if self.shared.hidden != self.hidden or shared_out != self.hidden:
            raise ValueError(f"the shared expert is not {self.hidden} wide")
        _check_shape("latent_in_weight", self.latent_in_weight, self.hidden, width)
        _check_shape("latent_out_weight", self.latent_out_weight, width, self.hidden)
        _check_shape("latent_in_bias", self.latent_in_bias, width)
        _check_shape("latent_out_bias", self.latent_out_bias, self.hidden)
        if self.latent_in_weight is None and width != self.hidden:
            raise ValueError(f"experts {width} wide need latent projections from {self.hidden}")
        for name in ("experts_up", "experts_down", "latent_in", "latent_out"):
            weight, scale = getattr(self, f"{name}_weight"), getattr(self, f"{name}_scale")
            if weight is not None:
                _check_weight(f"{name}_weight", weight, scale, len(matrix_shape(weight)) - 1)


@dataclass(frozen=True, eq=False)
class SoftmaxMoe(_Routed):
    """A mixture of gated experts with softmax routing: `softmax(x @ router)` over all experts
    (float32), the `top_k` best taken and their probabilities renormalised to sum 1; each
    expert `(act(x @ W_gate) * (x @ W_up)) @ W_down`, gate and up fused side by side. With a
    `shared` expert (a gated MLP every row takes), `sigmoid(x @ shared_gate_weight) * shared(x)` is
    added to the experts' sum. Only the experts a row routes to are read."""

    kind: ClassVar[Kind] = Kind.SOFTMAX_MOE
    router: torch.Tensor  # [hidden, E] float32
    experts_gate_up_weight: torch.Tensor  # [E, hidden, 2 mid]: gate, up columns
    experts_down_weight: torch.Tensor  # [E, mid, hidden]
    top_k: int
    activation: Activation = Activation.SILU
    experts_gate_up_scale: torch.Tensor | None = None  # [E, 2 mid]: int8 experts' scales
    experts_down_scale: torch.Tensor | None = None  # [E, hidden]
    shared: GatedMlp | None = None
    shared_gate_weight: torch.Tensor | None = None  # [hidden, 1], with `shared`
    shared_gate_scale: torch.Tensor | None = None  # [1]: an int8 shared_gate_weight's

    def __post_init__(self) -> None:
        num_experts, hidden, width = matrix_shape(self.experts_gate_up_weight)
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"top_k={self.top_k} must lie in [1, {num_experts}]")
        if Activation(self.activation) not in (Activation.SILU, Activation.GELU_TANH):
            raise ValueError(
                f"activation={self.activation!r}: a gated expert takes SILU or GELU_TANH"
            )
        if not (
            self.experts_gate_up_weight.is_contiguous() and self.experts_down_weight.is_contiguous()
        ):
            raise ValueError("expert weights must be contiguous stacks of [in, out] matrices")
        _check_shape("router", self.router, hidden, num_experts)
        _check_shape(
            "experts_down_weight", self.experts_down_weight, num_experts, width // 2, hidden
        )
        for name in ("experts_gate_up", "experts_down"):
            weight, scale = getattr(self, f"{name}_weight"), getattr(self, f"{name}_scale")
            _check_weight(f"{name}_weight", weight, scale, 2)
        if (self.shared is None) != (self.shared_gate_weight is None):
            raise ValueError("shared and shared_gate_weight come together")
        if self.shared is not None:
            if self.shared.hidden != hidden:
                raise ValueError(f"the shared expert is not {hidden} wide")
            _check_shape("shared_gate_weight", self.shared_gate_weight, hidden, 1)
            _check_weight("shared_gate_weight", self.shared_gate_weight, self.shared_gate_scale, 1)


@dataclass(frozen=True, eq=False)
class Mamba2:
    """Mamba2's one-token update: `in_proj` gives the gate z `[inner]`, the conv input x|B|C
    `[conv_dim]` and dt `[heads]`; x|B|C go through the depthwise causal conv (`kernel` taps,
    SiLU) after the row's stored inputs; `dt = softplus(dt + dt_bias)`, floored at
    `time_step_min` for prompt tokens; per head the SSM state `[head_dim, state_size]` decays
    by `exp(dt A)` and takes `dt B x`; `y = state . C + D x` (B, C of the head's group); the
    RMSNorm of `y * silu(z)` over each group's slice of inner, times `gate_norm`; `out_proj`.
    Its states are `state`'s in the step's recurrent states (the runner's: by layer id), a
    conv state `[conv_dim, kernel - 1]` and an SSM state `[heads, head_dim, state_size]` per
    state row, read and written in place."""

    kind: ClassVar[Kind] = Kind.MAMBA2
    in_proj_weight: torch.Tensor  # [hidden, inner + conv_dim + heads]
    out_proj_weight: torch.Tensor  # [inner, hidden]
    conv_weight: torch.Tensor  # [conv_dim, kernel]
    dt_bias: torch.Tensor  # [heads]
    A: torch.Tensor  # [heads], negative
    D: torch.Tensor  # [heads]
    gate_norm: torch.Tensor  # [inner]
    num_heads: int
    num_groups: int
    state_size: int
    state: int
    time_step_min: float
    conv_bias: torch.Tensor | None = None  # [conv_dim]
    in_proj_bias: torch.Tensor | None = None  # [inner + conv_dim + heads]
    out_proj_bias: torch.Tensor | None = None  # [hidden]
    in_proj_scale: torch.Tensor | None = None  # an int8 in_proj_weight's
    out_proj_scale: torch.Tensor | None = None  # an int8 out_proj_weight's

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.num_heads % self.num_groups:
            raise ValueError(f"num_groups={self.num_groups} must divide {self.num_heads} heads")
        inner = matrix_shape(self.out_proj_weight)[0]
        if inner % self.num_heads:
            raise ValueError(f"inner size {inner} is no multiple of {self.num_heads} heads")
        width = inner + self.conv_dim + self.num_heads
        _check_shape("in_proj_weight", self.in_proj_weight, self.hidden, width)
        _check_shape("in_proj_bias", self.in_proj_bias, width)
        _check_shape("out_proj_bias", self.out_proj_bias, self.hidden)
        _check_shape("conv_bias", self.conv_bias, self.conv_dim)
        if self.conv_weight.shape[0] != self.conv_dim or self.conv_weight.shape[1] < 2:
            raise ValueError(
                f"conv_weight {tuple(self.conv_weight.shape)}: [{self.conv_dim}, >= 2]"
            )
        for name in ("dt_bias", "A", "D"):
            _check_shape(name, getattr(self, name), self.num_heads)
        _check_shape("gate_norm", self.gate_norm, inner)
        _check_weight("in_proj_weight", self.in_proj_weight, self.in_proj_scale, 1)
        _check_weight("out_proj_weight", self.out_proj_weight, self.out_proj_scale, 1)

    @property
    def hidden(self) -> int:
        return matrix_shape(self.out_proj_weight)[1]

    @property
    def conv_dim(self) -> int:
        return matrix_shape(self.out_proj_weight)[0] + 2 * self.num_groups * self.state_size

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per state row: the conv state's shape and the SSM state's."""
        head_dim = matrix_shape(self.out_proj_weight)[0] // self.num_heads
        conv = (self.conv_dim, self.conv_weight.shape[1] - 1)
        return conv, (self.num_heads, head_dim, self.state_size)


@dataclass(frozen=True, eq=False)
class GatedDelta:
    """A Gated DeltaNet's one-token update: `in_proj` gives q|k|v `[conv_dim]`, the output gate
    z `[v_heads * v_dim]`, b and a `[v_heads]` each; q|k|v go through the depthwise causal
    conv (`kernel` taps, SiLU, no bias) after the row's stored inputs; q and k are
    L2-normalised per key head (q times `k_dim ** -0.5`); per value head, with its key head's q
    and k, `g = A softplus(a + dt_bias)`, `beta = sigmoid(b)`, the state `[k_dim, v_dim]`
    decays by `exp(g)` and takes `k (beta (v - k^T S))^T`, `y = S^T q`; y is RMS-normalised
    over the head, times `gate_norm` and `silu(z)`; `out_proj`. Its states are `state`'s in the
    step's recurrent states, a conv state `[conv_dim, kernel - 1]` and a delta-rule state
    `[v_heads, k_dim, v_dim]` per state row, read and written in place."""

    kind: ClassVar[Kind] = Kind.GATED_DELTA
    in_proj_weight: torch.Tensor  # [hidden, conv_dim + v_heads * v_dim + 2 v_heads]
    out_proj_weight: torch.Tensor  # [v_heads * v_dim, hidden]
    conv_weight: torch.Tensor  # [conv_dim, kernel]
    dt_bias: torch.Tensor  # [v_heads]
    A: torch.Tensor  # [v_heads], negative
    gate_norm: torch.Tensor  # [v_dim]
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    state: int
    in_proj_scale: torch.Tensor | None = None  # an int8 in_proj_weight's
    out_proj_scale: torch.Tensor | None = None  # an int8 out_proj_weight's

    def __post_init__(self) -> None:
        if self.num_k_heads < 1 or self.num_v_heads % self.num_k_heads or self.k_dim < 1:
            raise ValueError(
                f"num_k_heads={self.num_k_heads} must divide num_v_heads={self.num_v_heads}; "
                f"k_dim={self.k_dim} must be >= 1"
            )
        values = self.num_v_heads * self.v_dim
        _check_shape("out_proj_weight", self.out_proj_weight, values, self.hidden)
        width = self.conv_dim + values + 2 * self.num_v_heads
        _check_shape("in_proj_weight", self.in_proj_weight, self.hidden, width)
        if self.conv_weight.shape[0] != self.conv_dim or self.conv_weight.shape[1] < 2:
            raise ValueError(
                f"conv_weight {tuple(self.conv_weight.shape)}: [{self.conv_dim}, >= 2]"
            )
        for name in ("dt_bias", "A"):
            _check_shape(name, getattr(self, name), self.num_v_heads)
        _check_weight("in_proj_weight", self.in_proj_weight, self.in_proj_scale, 1)
        _check_weight("out_proj_weight", self.out_proj_weight, self.out_proj_scale, 1)

    @property
    def hidden(self) -> int:
        return matrix_shape(self.out_proj_weight)[1]

    @property
    def v_dim(self) -> int:
        return self.gate_norm.shape[0]

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per state row: the conv state's shape and the delta-rule state's."""
        conv = (self.conv_dim, self.conv_weight.shape[1] - 1)
        return conv, (self.num_v_heads, self.k_dim, self.v_dim)


Mixer = Attention | GatedMlp | Mlp | Moe | SoftmaxMoe | Mamba2 | GatedDelta
RECURRENT_MIXERS = (Mamba2, GatedDelta)  # the kinds that keep states (`state`, `state_shapes`)


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
    strides: a tied model's is the head's transpose, or the head itself where it is stored as
    panels, see `panels_shape`, or as int8 quad panels, `pack_quads`; int8 with
    `embedding_scales` `[vocab]`, a scale per row) times `embedding_scale`, the `blocks`, the
    final norm. `inv_freqs` are the rotary tables' frequencies `[D/2]` and `section` `[D/2]`
    the position row each frequency turns with (M-RoPE; zeros for 1-D positions); no tables
    (and `section` `[0]`) where no block rotates. Every RMSNorm divides by sqrt(mean(x^2) +
    `eps`). With a `head` (an LM head `[hidden, vocab]` as `engine.models.matmul.head_layout`
    stores it: row-major, its transpose, panels or int8 quad panels, int8 with `head_scales`
    `[vocab]`), a step may also give its rows' logits (`cpu_decode.CpuDecoder.decode`)."""

    blocks: Sequence[Block]
    embedding: torch.Tensor
    final_norm: torch.Tensor  # [hidden]
    inv_freqs: Sequence[torch.Tensor]
    section: torch.Tensor
    eps: float
    embedding_scale: float = 1.0
    embedding_scales: torch.Tensor | None = None
    head: torch.Tensor | None = None  # the LM head (`head_layout`), int8 with `head_scales`
    head_scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.inv_freqs) > MAX_TABLES:
            raise ValueError(f"{len(self.inv_freqs)} rotary tables; at most {MAX_TABLES} allowed")
        half = self.section.shape[0]
        hidden = self.final_norm.shape[0]
        if self.embedding.dim() != 2:  # a tied head's panels (or int8 quad panels)
            quads = is_quads(self.embedding)
            vocab = (matrix_shape if quads else panels_shape)(self.embedding)[1]
            if quads:
                _check_shape("embedding", self.embedding, hidden, vocab)
            else:
                shape = (vocab // PANEL_COLUMNS, hidden, PANEL_COLUMNS)
                _check_shape("embedding", self.embedding, *shape)
            if (self.embedding.dtype == torch.int8) != (self.embedding_scales is not None):
                raise ValueError("embedding: an int8 table needs scales, and only an int8 one")
            _check_shape("embedding scale", self.embedding_scales, vocab)
        else:
            _check_shape("embedding", self.embedding, self.embedding.shape[0], hidden)
            _check_weight("embedding", self.embedding, self.embedding_scales, 0)
        if self.head is not None:
            shape = (panels_shape if self.head.dim() == 3 else matrix_shape)(self.head)
            if shape[0] != hidden:
                raise ValueError(f"head: {shape[0]} inputs, the stack is {hidden} wide")
            if (self.head.dtype == torch.int8) != (self.head_scales is not None):
                raise ValueError("head: an int8 head needs scales, and only an int8 one")
            _check_shape("head scale", self.head_scales, shape[1])
        for table, inv_freq in enumerate(self.inv_freqs):
            _check_shape(f"inv_freqs[{table}]", inv_freq, half)
        for index, block in enumerate(self.blocks):
            mixer = block.mixer
            _check_shape(f"blocks[{index}].norm", block.norm, hidden)
            out = matrix_shape(mixer.down_weight)[1] if isinstance(mixer, Mlp) else hidden
            if mixer.hidden != hidden or out != hidden:
                raise ValueError(f"blocks[{index}] is {mixer.hidden} wide, the stack {hidden}")
            if not isinstance(mixer, Attention) or mixer.table is None:
                continue
            if mixer.head_dim != 2 * half:
                raise ValueError(
                    f"blocks[{index}] head_dim {mixer.head_dim} is not the rotary {2 * half}"
                )
            if mixer.table >= len(self.inv_freqs):
                raise ValueError(
                    f"blocks[{index}] rotary table {mixer.table} of {len(self.inv_freqs)}"
                )

    @property
    def hidden(self) -> int:
        return self.final_norm.shape[0]
