"""NemotronH's blocks: a pre-norm mixer plus a residual; here the attention and MLP mixers.

Every block is `hidden + mixer(rms_norm(hidden))` with its own RMSNorm (computed in float32,
as transformers does). Attention is GQA over the paged K/V cache with no rotary embedding: in
this family the Mamba2 layers carry the order of the tokens. The MLP (and each expert of the
MoE blocks, `nemotron_moe`) is `down(relu(up(x))²)`. Weights are `[in, out]` for `linear`,
built from a checkpoint-named module whose tensors the loader already stored in their formats
(matrices as stored or int8 with `weight_scale`, the rest in the compute dtype), and prepared
once for its products (`prepare_projections`).
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.models.matmul import ProjectingModule, StoredMatrix, linear, scale_of
from stillcut.engine.models.nemotron_omni.text_config import NemotronTextConfig
from stillcut.engine.models.weights import fused_weight, set_weight
from stillcut.kernels.attention import paged_attention, write_kv
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.stack import Activation, Attention, Mixer, Mlp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, returned in `x`'s dtype."""
    return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(x.dtype)


def frozen(tensor: torch.Tensor | None) -> nn.Parameter | None:
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


def relu2_mlp(
    x: torch.Tensor,
    up: StoredMatrix,
    down: StoredMatrix,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`down(relu(up(x))²)`: `x` `[N, in]`, `up` `[in, mid]`, `down` `[mid, out]`."""
    hidden = linear(x, up, up_bias)  # [N, mid]
    hidden = torch.relu_(hidden).square_()
    return linear(hidden, down, down_bias)  # [N, out]


def set_projection(module: nn.Module, name: str, linears: list[nn.Module]) -> None:
    """`module.<name>`: the `[in, out]` weight of checkpoint-named `linears` side by side (and
    `<name>_scale` when int8)."""
    set_weight(module, name, *fused_weight(linears))


class NemotronBlock(ProjectingModule, abc.ABC):
    """A block's norm and the `[in, out]` weights it multiplies by (see `projections`)."""

    def __init__(self, norm: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.norm = frozen(norm)
        self.eps = eps

    @abc.abstractmethod
    def forward(
        self, hidden: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor | None
    ) -> torch.Tensor:
        """The residual stream `[N, hidden]` after this block (each block kind's own)."""

    @abc.abstractmethod
    def native_mixer(self, cache: int) -> Mixer:
        """The mixer as the native CPU decode step reads it (`cache`: the step's KV cache an
        attention block uses)."""


class AttentionBlock(NemotronBlock):
    """GQA attention, no rotary, no biases; q, k and v fused into one `[in, out]` weight."""

    projections = ("qkv_weight", "o_weight")

    def __init__(self, stored: nn.Module, config: NemotronTextConfig) -> None:
        super().__init__(stored.norm.weight, config.layer_norm_epsilon)
        mixer = stored.mixer
        # [hidden, (Hq + 2 Hkv) D] and [Hq D, hidden]
        set_projection(self, "qkv_weight", [mixer.q_proj, mixer.k_proj, mixer.v_proj])
        set_projection(self, "o_weight", [mixer.o_proj])
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5

    def forward(
        self, hidden: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor | None
    ) -> torch.Tensor:
        assert kv_cache is not None
        num_tokens = hidden.shape[0]
        normed = rms_norm(hidden, self.norm, self.eps)
        qkv = linear(normed, self.matrix("qkv_weight"))
        heads = qkv.view(num_tokens, -1, self.head_dim)  # [N, Hq + 2 Hkv, D]
        query, key, value = heads.split(
            (self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1
        )
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        attended = paged_attention(query, kv_cache, metadata, scale=self.scale)  # [N, Hq, D]
        attended = attended.reshape(num_tokens, -1)  # [N, Hq D]
        return linear(attended, self.matrix("o_weight"), hidden)

    def native_mixer(self, cache: int) -> Attention:
        return Attention(
            self.qkv_weight,
            self.o_weight,
            self.num_heads,
            self.num_kv_heads,
            cache=cache,
            scale=self.scale,
            table=None,  # no rotary embedding
            qkv_scale=scale_of(self, "qkv_weight"),
            o_scale=scale_of(self, "o_weight"),
        )


class MLPBlock(NemotronBlock):
    """`down(relu(up(x))²)`, biases when the config has `mlp_bias`."""

    projections = ("up", "down")

    def __init__(self, stored: nn.Module, config: NemotronTextConfig) -> None:
        super().__init__(stored.norm.weight, config.layer_norm_epsilon)
        mixer = stored.mixer
        set_projection(self, "up", [mixer.up_proj])  # [hidden, mid]
        set_projection(self, "down", [mixer.down_proj])  # [mid, hidden]
        self.up_bias = frozen(mixer.up_proj.bias)
        self.down_bias = frozen(mixer.down_proj.bias)

    def forward(
        self, hidden: torch.Tensor, metadata: AttentionMetadata, kv_cache: torch.Tensor | None
    ) -> torch.Tensor:
        normed = rms_norm(hidden, self.norm, self.eps)
        out = relu2_mlp(
            normed, self.matrix("up"), self.matrix("down"), self.up_bias, self.down_bias
        )
        return hidden + out

    def native_mixer(self, cache: int) -> Mlp:
        return native_relu2_mlp(self, "up", "down", self.up_bias, self.down_bias)


def native_relu2_mlp(
    module: nn.Module,
    up: str,
    down: str,
    up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> Mlp:
    """`module`'s relu² MLP of projections `up` and `down` (and their int8 scales) as the
    native decode step reads it."""
    return Mlp(
        getattr(module, up),
        getattr(module, down),
        Activation.RELU2,
        up_bias=up_bias,
        down_bias=down_bias,
        up_scale=scale_of(module, up),
        down_scale=scale_of(module, down),
    )


def stored_mlp(in_size: int, mid_size: int, bias: bool) -> nn.Module:
    """A meta-device `up_proj` / `down_proj` pair, named as the checkpoint names them."""
    with torch.device("meta"):
        mlp = nn.Module()
        mlp.up_proj = nn.Linear(in_size, mid_size, bias=bias)
        mlp.down_proj = nn.Linear(mid_size, in_size, bias=bias)
    return mlp


def stored_attention(config: NemotronTextConfig) -> nn.Module:
    """A meta-device attention mixer named as the checkpoint names it (no biases)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim
    with torch.device("meta"):
        mixer = nn.Module()
        mixer.q_proj = nn.Linear(hidden, q_width, bias=False)
        mixer.k_proj = nn.Linear(hidden, kv_width, bias=False)
        mixer.v_proj = nn.Linear(hidden, kv_width, bias=False)
        mixer.o_proj = nn.Linear(q_width, hidden, bias=False)
    return mixer
