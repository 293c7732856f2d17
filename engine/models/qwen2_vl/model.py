"""The Qwen2 language model of Qwen2-VL and Qwen2.5-VL, for the runner's flat token batches.

One step runs N tokens of any mix of requests: embeddings (video/image embeddings scattered into
their placeholder rows), then decoder layers of GQA attention over the paged KV cache and a
SwiGLU MLP, each behind an RMSNorm and a residual. Positions are M-RoPE (t, h, w) triples. Batch-1
decode is bound by reading the weights, so linear weights are fused (q/k/v, gate/up), applied
as `x @ w` with `w` `[in, out]` through `layers.linear` (banded matvecs for a few rows on CPU),
and stored in whichever memory order it reads faster (`matmul_layout`); the residual add rides
along in the product. The head is `[hidden, vocab]` contiguous, and a tied model gathers its
embeddings from the head's columns instead of keeping a second vocab x hidden copy. Matrices
(and the embedding) stay in their stored format (`engine.quantization`); norms and biases are
in the compute dtype, which is the dtype of everything the layers compute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.checkpoint import CheckpointLike, open_checkpoint
from stillcut.engine.loader import checkpoint_dtype, load_weights
from stillcut.engine.model_config import ModelConfig
from stillcut.engine.models.base import PagedLanguageModel
from stillcut.engine.models.matmul import (
    PROJECTIONS,
    ProjectingModule,
    head_layout,
    head_table,
    linear,
    scale_of,
)
from stillcut.engine.models.qwen2_vl.config import TextConfig, text_config
from stillcut.engine.models.qwen2_vl.positions import (
    MRopeCursor,
    MRopePositions,
    MRopeSpec,
    extend_mrope,
    mrope_positions,
)
from stillcut.engine.models.rotary import fused_qkv_attention, rotary_tables
from stillcut.engine.models.weights import (
    checkpoint_layer,
    checkpoint_layout,
    embedding_rows,
    empty_weight,
    fuse_projections,
    load_head,
    set_weight,
)
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.quantization import Conversion, WeightFormat, matmul_weights, plan_formats
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.stack import Activation, Attention, Block, GatedMlp, Mixer, Stack

LANGUAGE_MODEL_PREFIX = "language_model."


class MRoPE(nn.Module):
    """cos/sin tables of M-RoPE: rotary half-dim j turns at position row `section[j]` (t, h, w)
    times `inv_freq[j]`; the sections are contiguous, temporal first, as in transformers."""

    def __init__(self, config: TextConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # The same float32 ops as transformers: the angles must match to the last bit.
        exponent = torch.arange(0, config.head_dim, 2, device=device).float() / config.head_dim
        turns = config.rope_theta**exponent
        if config.rope_factors is not None:  # LongRoPE: each frequency divided by its factor
            turns = torch.tensor(config.rope_factors, device=device) * turns
        self.inv_freq = nn.Buffer(1.0 / turns, persistent=False)  # [D/2]
        rows = torch.arange(3, device=device).repeat_interleave(
            torch.tensor(config.mrope_section, device=device)
        )
        self.section = nn.Buffer(rows, persistent=False)  # [D/2] in {0, 1, 2}

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` [3, N] long -> cos and signed sin `[N, 1, D]`, shared by every layer."""
        angles = positions[self.section].T.float() * self.inv_freq  # [N, D/2]
        return rotary_tables(angles, dtype)


class Qwen2DecoderLayer(ProjectingModule):
    """Pre-norm attention and SwiGLU MLP with fused weights, all `[in, out]` in shape."""

    projections = PROJECTIONS
    # a function of the q and k heads [N, Hq + Hkv, D] before rotary (Qwen3's per-head norm)
    qk_transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, config: TextConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.eps = config.rms_norm_eps
        self.scale = head_dim**-0.5
        qkv_width = (config.num_heads + 2 * config.num_kv_heads) * head_dim
        new = {"dtype": dtype, "device": device}
        self.input_layernorm = empty_weight(hidden, **new)
        self.qkv_weight = empty_weight(hidden, qkv_width, **new)  # [in, out]: [q | k | v] columns
        self.qkv_bias = empty_weight(qkv_width, **new)
        self.o_weight = empty_weight(config.num_heads * head_dim, hidden, **new)
        self.post_attention_layernorm = empty_weight(hidden, **new)
        self.gate_up_weight = empty_weight(
            hidden, 2 * config.intermediate_size, **new
        )  # [gate | up]
        self.down_weight = empty_weight(config.intermediate_size, hidden, **new)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`hidden` [N, hidden] (the residual stream) -> the next layer's residual stream."""
        normed = F.rms_norm(hidden, hidden.shape[-1:], self.input_layernorm, self.eps)
        qkv = linear(normed, self.matrix("qkv_weight"), self.qkv_bias)  # [N, (Hq + 2 Hkv) * D]
        attended = fused_qkv_attention(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            cos,
            sin,
            kv_cache,
            metadata,
            qk_transform=self.qk_transform,
            scale=self.scale,
        )  # [N, Hq * D]
        hidden = linear(attended, self.matrix("o_weight"), hidden)

        normed = F.rms_norm(hidden, hidden.shape[-1:], self.post_attention_layernorm, self.eps)
        return self.feed_forward(normed, hidden)

    def feed_forward(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` + the SwiGLU MLP of `normed` [N, hidden]."""
        gate_up = linear(normed, self.matrix("gate_up_weight"))  # [N, 2 * intermediate]
        gate, up = gate_up.chunk(2, dim=-1)
        # In place on our own temporary: the decode step allocates nothing more for SwiGLU.
        activated = F.silu(gate, inplace=True).mul_(up)  # [N, intermediate]
        return linear(activated, self.matrix("down_weight"), residual)  # [N, hidden]

    def native_mlp(self) -> Mixer:
        """The layer's MLP as a block of the native CPU decode step: the SiLU gated MLP."""
        return GatedMlp(
            self.gate_up_weight,
            self.down_weight,
            Activation.SILU,
            gate_up_scale=scale_of(self, "gate_up_weight"),
            down_scale=scale_of(self, "down_weight"),
        )


class Qwen2LanguageModel(PagedLanguageModel):
    """Qwen2 decoder over a flat batch of tokens with paged KV; build with `from_checkpoint`.

    A tied model holds the embedding only as `lm_head` `[hidden, vocab]` (`embed_tokens` is
    None); an untied one holds the embedding `[vocab, hidden]` and the head `[hidden, vocab]`.
    Int8 tables have `lm_head_scale` `[vocab]` / `embed_tokens_scale` `[vocab]` beside them.
    `rope_spec` holds the checkpoint's placeholder ids and video time scale for
    `prompt_positions`.
    """

    num_position_rows = 3  # M-RoPE: temporal, height, width
    bidirectional_item_tokens = 0  # images have no fixed size: admission checks each item
    # what a subclass of the same build (Qwen3) replaces: its layers and its rotary tables
    layer_class: type[nn.Module] = Qwen2DecoderLayer
    rotary_class: type[nn.Module] = MRoPE

    def __init__(
        self,
        config: TextConfig,
        rope_spec: MRopeSpec,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.rope_spec = rope_spec
        new = {"dtype": dtype, "device": device}
        self.embed_tokens = (
            None
            if config.tie_word_embeddings
            else empty_weight(config.vocab_size, config.hidden_size, **new)
        )
        self.layers = nn.ModuleList(
            self.layer_class(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = empty_weight(config.hidden_size, **new)
        self.lm_head = empty_weight(config.hidden_size, config.vocab_size, **new)
        self.rotary = self.rotary_class(config, device)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over input embeddings `hidden` [N, hidden] -> final-normed [N, hidden].

        `positions` [3, N] long are M-RoPE (t, h, w) positions; `kv_caches` has one
        `kv_cache_shape` tensor per layer.
        """
        cos, sin = self.rotary(positions, hidden.dtype)  # [N, 1, D] each
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, metadata)
        return F.rms_norm(hidden, hidden.shape[-1:], self.norm, self.config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings in the compute dtype: [N] ids -> [N, hidden]."""
        if self.embed_tokens is None:
            # the tied head's rows are the embedding table (see `head_layout`)
            table, scale = head_table(self.lm_head), scale_of(self, "lm_head")
        else:
            table, scale = self.embed_tokens, scale_of(self, "embed_tokens")
        return embedding_rows(input_ids, table, scale, self.norm.dtype)

    def prompt_positions(
        self,
        token_ids: torch.Tensor,
        items: Sequence[MultiModalItem],
        placements: Sequence[tuple[int, int]] | None = None,
    ) -> MRopePositions:
        """M-RoPE positions [3, prompt_len] of a prompt, and where the tokens after it go.
        `placements` (offset, length) per item; by default read off the placeholder runs."""
        return mrope_positions(token_ids, items, self.rope_spec, placements)

    def extend_positions(
        self,
        cursor: MRopeCursor | None,
        token_ids: torch.Tensor,
        items: Sequence[MultiModalItem],
        placements: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, MRopeCursor]:
        """M-RoPE positions [3, n] of tokens appended after `cursor` (None: a sequence's
        start) and the cursor after them (see `extend_mrope`)."""
        return extend_mrope(cursor or MRopeCursor(), token_ids, items, self.rope_spec, placements)

    @classmethod
    def from_checkpoint(
        cls,
        path: CheckpointLike,
        weight_format: WeightFormat = WeightFormat(),
        device: torch.device | str = "cpu",
    ) -> Qwen2LanguageModel:
        """The language model of a checkpoint folder (or hub id), in eval mode, its weights
        stored as `weight_format` says (default: as the checkpoint stores them).

        Loads `language_model.*` (and `lm_head.*` when untied) strictly through the shared
        loader: missing, unexpected or misshapen tensors raise CheckpointError. A tied
        checkpoint's `lm_head.weight`, if saved at all, is the embedding and is not read.
        """
        checkpoint = open_checkpoint(path)
        model_config = checkpoint.config
        config = cls.read_text_config(model_config)
        weight_format = weight_format.resolved(checkpoint_dtype(checkpoint))
        rope_spec = MRopeSpec(
            model_config.image_token_id,
            model_config.video_token_id,
            tokens_per_second=model_config.vision.tokens_per_second,  # None: Qwen2-VL's steps
        )
        stored = cls.checkpoint_layout(config)
        load_weights(
            stored,
            checkpoint,
            LANGUAGE_MODEL_PREFIX,
            device=device,
            formats=_stored_formats(
                stored, weight_format, config.tie_word_embeddings, cls.stacked_matmuls(stored)
            ),
        )
        model = cls(config, rope_spec, dtype=weight_format.compute_dtype, device=device)
        model.weight_format = weight_format
        for layer in model.layers:
            cls.fill_layer(layer, stored.layers.pop(0))  # pop: frees each stored layer once fused
        set_weight(model, "norm", stored.norm.weight)
        table = stored.embed_tokens
        if config.tie_word_embeddings:
            set_weight(model, "lm_head", head_layout(table.weight), scale_of(table, "weight"))
        else:
            head = load_head(
                checkpoint, config.hidden_size, config.vocab_size, weight_format, device
            )
            set_weight(model, "embed_tokens", table.weight, scale_of(table, "weight"))
            set_weight(model, "lm_head", head_layout(head.weight), scale_of(head, "weight"))
        model.prepare_weights()
        return model.eval()

    @staticmethod
    def read_text_config(model_config: ModelConfig) -> TextConfig:
        """The language model's config from the checkpoint's."""
        return text_config(model_config)

    @staticmethod
    def checkpoint_layout(config: TextConfig) -> nn.Module:
        """Meta-device modules named like the checkpoint's `language_model.*` tensors."""
        return _checkpoint_layout(config)

    @staticmethod
    def stacked_matmuls(stored: nn.Module) -> dict[str, int]:
        """State name -> output axis of the stacks of matrices (experts) among the
        checkpoint-named `stored` tensors, stored and quantized matrix by matrix: none."""
        return {}

    @staticmethod
    def fill_layer(layer: nn.Module, stored: nn.Module) -> None:
        """Fill one decoder layer from its checkpoint-named layer."""
        _fuse_layer(layer, stored)

    def native_stack(self) -> Stack | None:
        """Each layer as two blocks for the native CPU decode step: biased attention, then its
        MLP's (`native_mlp`); the embedding is the tied head's rows when there is no table of
        its own."""
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
                qkv_bias=layer.qkv_bias,
                qkv_scale=scale_of(layer, "qkv_weight"),
                o_scale=scale_of(layer, "o_weight"),
            )
            blocks += [Block(layer.input_layernorm, attention)]
            blocks += [Block(layer.post_attention_layernorm, layer.native_mlp())]
        return self.tables_stack(
            blocks, [self.rotary.inv_freq], self.rotary.section, config.rms_norm_eps
        )


def _stored_formats(
    stored: nn.Module, weight_format: WeightFormat, tied: bool, stacks: Mapping[str, int]
) -> dict[str, Conversion]:
    """How each `language_model.*` tensor is stored: a tied table is the LM head (laid out as
    its transpose, kept unquantized when the head is); `stacks` (name -> output axis) are
    stacked experts, quantized expert by expert."""
    table = "embed_tokens.weight"
    head_kept = tied and not weight_format.quantizes("lm_head")
    return plan_formats(
        stored,
        weight_format,
        matmul_weights(stored, {table: 0, **stacks}),
        unquantized=(table,) if head_kept else (),
        heads=(table,) if tied else (),
        stacks=stacks,
    )


def _fuse_layer(layer: Qwen2DecoderLayer, stored: nn.Module) -> None:
    """Fill `layer` from a checkpoint-named layer: [in, out] shapes, q/k/v and gate/up fused."""
    attn = stored.self_attn
    fuse_projections(layer, stored)
    set_weight(
        layer, "qkv_bias", torch.cat([p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
    )
    set_weight(layer, "input_layernorm", stored.input_layernorm.weight)
    set_weight(layer, "post_attention_layernorm", stored.post_attention_layernorm.weight)


def _checkpoint_layout(config: TextConfig) -> nn.Module:
    """Meta-device modules named like a checkpoint's `language_model.*` tensors."""
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layers = [
        checkpoint_layer(
            config.hidden_size,
            config.intermediate_size,
            q_width,
            kv_width,
            qkv_bias=True,
            norms=("input_layernorm", "post_attention_layernorm"),
        )
        for _ in range(config.num_layers)
    ]
    return checkpoint_layout(config.vocab_size, config.hidden_size, layers)
