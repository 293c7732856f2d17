"""The Gemma 3 language model, for the runner's flat token batches.

Text embeddings are scaled by sqrt(hidden) in the model dtype; image soft tokens replace their
rows unscaled. Each decoder layer is GQA attention with RMS-normed q and k heads, then a GeGLU
MLP (tanh GELU), each wrapped in its own pre- and post-norm; every norm scales by `1 + weight`
in float32, so the stored scales are `1 + weight` already. Local layers attend within a sliding
window of sequence slots, global layers to everything; each kind rotates with its own RoPE base,
the global one with linear position scaling. Attention scores scale by
`query_pre_attn_scalar ** -0.5`, and the config may soft-cap scores and logits. Positions are
1-D; EVS-pruned image tokens keep the ids they had unpruned (`gemma3_positions`). The head is
the tied embedding, `[hidden, vocab]`. Weights are fused, laid out and stored as in `qwen2`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.checkpoint import CheckpointLike, open_checkpoint
from stillcut.engine.loader import checkpoint_dtype, load_weights
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.models.base import PagedLanguageModel
from stillcut.engine.models.gemma3.positions import gemma3_positions
from stillcut.engine.models.gemma3.text_config import (
    LAYER_TYPES,
    SLIDING,
    Gemma3TextConfig,
    gemma3_text_config,
)
from stillcut.engine.models.matmul import (
    PROJECTIONS,
    ProjectingModule,
    head_layout,
    head_table,
    linear,
    scale_of,
)
from stillcut.engine.models.rotary import fused_qkv_attention, rotary_tables
from stillcut.engine.models.weights import (
    checkpoint_layer,
    checkpoint_layout,
    embedding_rows,
    empty_weight,
    fuse_projections,
    set_weight,
)
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.quantization import WeightFormat, matmul_weights, plan_formats
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.stack import Activation, Attention, Block, GatedMlp, Stack

LANGUAGE_MODEL_PREFIX = "language_model."
# A checkpoint layer's norms -> ours (their `1 + weight`, float32).
_NORMS = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "pre_feedforward_norm",
    "post_feedforward_layernorm": "post_feedforward_norm",
}


def _norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim, in float32: `scale` is the float32 `1 + weight`."""
    return (F.rms_norm(x.float(), x.shape[-1:], eps=eps) * scale).to(x.dtype)


class Gemma3Rope(nn.Module):
    """cos/sin tables for each layer type: its own base, and linear scaling where configured."""

    def __init__(self, config: Gemma3TextConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # The same float32 ops as transformers, so the angles match to the last bit.
        exponent = torch.arange(0, config.head_dim, 2, device=device).float() / config.head_dim
        for kind in LAYER_TYPES:
            rope = config.rope[kind]
            inv_freq = 1.0 / rope.theta**exponent / rope.factor  # [D/2]
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`positions` [N] long -> layer type -> cos and signed sin `[N, 1, D]`."""
        angles = positions.float()[:, None]  # [N, 1]
        return {
            kind: rotary_tables(angles * getattr(self, f"{kind}_inv_freq"), dtype)
            for kind in LAYER_TYPES
        }


class Gemma3DecoderLayer(ProjectingModule):
    """Sandwich-normed attention (local or global) and GeGLU MLP, weights `[in, out]`."""

    projections = PROJECTIONS

    def __init__(
        self,
        config: Gemma3TextConfig,
        layer_type: str,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.layer_type = layer_type
        self.sliding_window = config.sliding_window if layer_type == SLIDING else None
        self.soft_cap = config.attn_logit_softcapping
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.eps = config.rms_norm_eps
        self.scale = config.query_pre_attn_scalar**-0.5
        new = {"dtype": dtype, "device": device}
        norm = {"dtype": torch.float32, "device": device}
        qkv_width = (config.num_heads + 2 * config.num_kv_heads) * head_dim
        self.input_norm = empty_weight(hidden, **norm)
        self.qkv_weight = empty_weight(hidden, qkv_width, **new)  # [in, out]: [q | k | v]
        self.qk_norm = empty_weight(config.num_heads + config.num_kv_heads, head_dim, **norm)
        self.o_weight = empty_weight(config.num_heads * head_dim, hidden, **new)
        self.post_attention_norm = empty_weight(hidden, **norm)
        self.pre_feedforward_norm = empty_weight(hidden, **norm)
        self.gate_up_weight = empty_weight(hidden, 2 * config.intermediate_size, **new)
        self.down_weight = empty_weight(config.intermediate_size, hidden, **new)
        self.post_feedforward_norm = empty_weight(hidden, **norm)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`hidden` [N, hidden] (the residual stream) -> the next layer's residual stream."""
        qkv = linear(
            _norm(hidden, self.input_norm, self.eps), self.matrix("qkv_weight")
        )  # [N, (Hq+2Hkv) * D]
        attended = fused_qkv_attention(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            cos,
            sin,
            kv_cache,
            metadata,
            qk_transform=lambda qk: _norm(qk, self.qk_norm, self.eps),  # per-head scales
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.soft_cap,
        )  # [N, Hq * D]
        attended = linear(attended, self.matrix("o_weight"))  # [N, hidden]
        hidden = hidden + _norm(attended, self.post_attention_norm, self.eps)

        gate_up = linear(
            _norm(hidden, self.pre_feedforward_norm, self.eps), self.matrix("gate_up_weight")
        )
        gate, up = gate_up.chunk(2, dim=-1)  # [N, intermediate] each
        activated = F.gelu(gate, approximate="tanh").mul_(up)  # [N, intermediate]
        mlp_out = linear(activated, self.matrix("down_weight"))  # [N, hidden]
        return hidden + _norm(mlp_out, self.post_feedforward_norm, self.eps)


class Gemma3LanguageModel(PagedLanguageModel):
    """Gemma 3 decoder over a flat batch of tokens with paged KV; build with `from_checkpoint`.

    The embedding lives only as the tied head `lm_head` `[hidden, vocab]`. `image_token_id` is
    the soft-token placeholder and `boi_token_id` the `<start_of_image>` that precedes every
    image; `mm_tokens_per_image` is an unpruned image's token count, and so the longest
    bidirectional item a prompt holds.
    """

    num_position_rows = 1

    def __init__(
        self,
        config: Gemma3TextConfig,
        *,
        image_token_id: int,
        boi_token_id: int,
        mm_tokens_per_image: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.image_token_id = image_token_id
        self.boi_token_id = boi_token_id
        self.bidirectional_item_tokens = mm_tokens_per_image
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, layer_type, dtype, device)
            for layer_type in config.layer_types
        )
        self.norm = empty_weight(config.hidden_size, dtype=torch.float32, device=device)
        self.lm_head = empty_weight(
            config.hidden_size, config.vocab_size, dtype=dtype, device=device
        )
        self.rotary = Gemma3Rope(config, device)
        # transformers rounds sqrt(hidden) to the weights' dtype before scaling (55.5 in bf16).
        self.embed_scale = nn.Buffer(
            torch.tensor(config.hidden_size**0.5, device=device).to(dtype), persistent=False
        )

    def input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings scaled by sqrt(hidden), as Gemma's are: [N] ids -> [N, hidden]."""
        return self.embed(input_ids).mul_(self.embed_scale)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over input embeddings `hidden` [N, hidden] -> final-normed [N, hidden].

        `positions` [1, N] long; `kv_caches` has one `kv_cache_shape` tensor per layer. Media
        rows hold their embeddings unscaled (they replace the scaled token embeddings).
        """
        tables = self.rotary(positions[0], hidden.dtype)  # layer type -> [N, 1, D] each
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, *tables[layer.layer_type], kv_cache, metadata)
        return _norm(hidden, self.norm, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Unscaled token embeddings in the compute dtype: [N] ids -> [N, hidden], gathered
        from the head's columns (its rows, see `head_layout`)."""
        return embedding_rows(
            input_ids, head_table(self.lm_head), scale_of(self, "lm_head"), self.embed_scale.dtype
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits [S, vocab] of the rows that sample, soft-capped if the config says so."""
        logits = self.head_logits(hidden_states)  # [S, vocab]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def prompt_positions(
        self,
        token_ids: torch.Tensor,
        items: Sequence[MultiModalItem],
        placements: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """1-D positions [1, prompt_len] of a prompt, and the position of the token after it:
        kept image tokens at their unpruned ids (see `gemma3_positions`). `placements`
        (offset, length) per item; by default each item follows the next `<start_of_image>`."""
        return gemma3_positions(
            token_ids,
            items,
            placements,
            image_token_id=self.image_token_id,
            boi_token_id=self.boi_token_id,
        )

    @classmethod
    def from_checkpoint(
        cls,
        path: CheckpointLike,
        weight_format: WeightFormat = WeightFormat(),
        device: torch.device | str = "cpu",
    ) -> Gemma3LanguageModel:
        """The language model of a Gemma 3 checkpoint folder (or hub id), in eval mode, its
        weights stored as `weight_format` says (default: as the checkpoint stores them).

        Loads `language_model.*` strictly through the shared loader: missing, unexpected or
        misshapen tensors raise CheckpointError. The head is the tied embedding; a saved
        `lm_head.weight` is that same tensor and is not read.
        """
        checkpoint = open_checkpoint(path)
        model_config = checkpoint.config
        config = gemma3_text_config(model_config)
        if not config.tie_word_embeddings:
            raise CheckpointError("Gemma 3 with tie_word_embeddings=false is not supported")
        weight_format = weight_format.resolved(checkpoint_dtype(checkpoint))
        stored = _checkpoint_layout(config)
        table = "embed_tokens.weight"  # the tied head: laid out as its transpose
        formats = plan_formats(
            stored,
            weight_format,
            matmul_weights(stored, {table: 0}),
            unquantized=() if weight_format.quantizes("lm_head") else (table,),
            heads=(table,),
        )
        load_weights(stored, checkpoint, LANGUAGE_MODEL_PREFIX, device=device, formats=formats)
        model = cls(
            config,
            image_token_id=model_config.image_token_id,
            boi_token_id=model_config.vision_start_token_id,
            mm_tokens_per_image=model_config.vision.mm_tokens_per_image,
            dtype=weight_format.compute_dtype,
            device=device,
        )
        model.weight_format = weight_format
        for layer in model.layers:
            _fuse_layer(layer, stored.layers.pop(0))  # pop: frees each stored layer once fused
        set_weight(model, "norm", _scale(stored.norm))
        embedding = stored.embed_tokens
        set_weight(model, "lm_head", head_layout(embedding.weight), scale_of(embedding, "weight"))
        model.prepare_weights()
        return model.eval()

    def native_stack(self) -> Stack:
        """Each layer as two sandwich-normed blocks for the native CPU decode step: attention
        with q/k norms, its layer type's window and rotary table and the score soft cap; tanh
        GELU gated MLP. The embedding is the tied head's rows (see `head_layout`)."""
        config = self.config
        blocks = []
        for index, layer in enumerate(self.layers):
            attention = Attention(
                layer.qkv_weight,
                layer.o_weight,
                config.num_heads,
                config.num_kv_heads,
                cache=index,
                scale=layer.scale,
                qk_norm=layer.qk_norm,
                window=layer.sliding_window or 0,
                table=LAYER_TYPES.index(layer.layer_type),
                soft_cap=layer.soft_cap or 0.0,
                qkv_scale=scale_of(layer, "qkv_weight"),
                o_scale=scale_of(layer, "o_weight"),
            )
            mlp = GatedMlp(
                layer.gate_up_weight,
                layer.down_weight,
                Activation.GELU_TANH,
                gate_up_scale=scale_of(layer, "gate_up_weight"),
                down_scale=scale_of(layer, "down_weight"),
            )
            blocks += [
                Block(layer.input_norm, attention, out_norm=layer.post_attention_norm),
                Block(layer.pre_feedforward_norm, mlp, out_norm=layer.post_feedforward_norm),
            ]
        return Stack(
            blocks,
            embedding=head_table(self.lm_head),
            embedding_scales=scale_of(self, "lm_head"),
            final_norm=self.norm,
            inv_freqs=[getattr(self.rotary, f"{kind}_inv_freq") for kind in LAYER_TYPES],
            section=torch.zeros(config.head_dim // 2, dtype=torch.int32),  # 1-D positions
            eps=config.rms_norm_eps,
            embedding_scale=float(self.embed_scale),
            head=self.lm_head,
            head_scales=scale_of(self, "lm_head"),
        )


def _scale(norm: nn.Module) -> torch.Tensor:
    """A Gemma RMSNorm's float32 `1 + weight`."""
    return 1.0 + norm.weight.float()


def _fuse_layer(layer: Gemma3DecoderLayer, stored: nn.Module) -> None:
    """Fill `layer` from a checkpoint-named layer: [in, out] shapes, q/k/v and gate/up fused,
    norms as their float32 `1 + weight`, the q and k norms stacked per head."""
    attn = stored.self_attn
    fuse_projections(layer, stored)
    qk_norm = torch.cat(
        [
            _scale(attn.q_norm).expand(layer.num_heads, -1),
            _scale(attn.k_norm).expand(layer.num_kv_heads, -1),
        ]
    )  # [Hq + Hkv, D]
    set_weight(layer, "qk_norm", qk_norm)
    for stored_name, name in _NORMS.items():
        set_weight(layer, name, _scale(getattr(stored, stored_name)))


def _checkpoint_layout(config: Gemma3TextConfig) -> nn.Module:
    """Meta-device modules named like a checkpoint's `language_model.*` tensors."""
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    layers = []
    for _ in range(config.num_layers):
        layer = checkpoint_layer(
            config.hidden_size,
            config.intermediate_size,
            q_width,
            kv_width,
            qkv_bias=False,
            norms=tuple(_NORMS),
        )
        with torch.device("meta"):
            layer.self_attn.q_norm = nn.RMSNorm(config.head_dim)
            layer.self_attn.k_norm = nn.RMSNorm(config.head_dim)
        layers.append(layer)
    return checkpoint_layout(config.vocab_size, config.hidden_size, layers)
