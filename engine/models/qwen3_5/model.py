"""The Qwen3.5 language model (dense and MoE), for the runner's flat token batches.

A stack of layers, each a token mixer (a Gated DeltaNet, `delta_net`, or gated partial-rotary
attention, `attention`) and an MLP (`mlp`: SwiGLU, or the mixture with a shared expert), each
behind an RMSNorm and a residual, between an embedding and a final norm. Every such RMSNorm
scales by `1 + w` (zero-centred weights): the `1 + w` is made once at load, so the norms are
plain RMSNorms from then on. Attention layers take the runner's paged K/V caches in layer
order; DeltaNet layers read and write their states through `metadata.recurrent`. Positions are
M-RoPE triples placed as Qwen2-VL's model places them (the timestamped tubelets are items of
their own). Weights load as the checkpoint stores them; multi-token-prediction tensors
(`mtp.*`) are skipped with a log line, as transformers skips them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.checkpoint import CheckpointLike, open_checkpoint
from stillcut.engine.loader import checkpoint_dtype
from stillcut.engine.models.base import PagedLanguageModel
from stillcut.engine.models.qwen2_vl.model import Qwen2LanguageModel
from stillcut.engine.models.qwen2_vl.positions import MRopeSpec
from stillcut.engine.models.qwen3_5.attention import (
    GatedAttention,
    PartialMRoPE,
    stored_attention,
)
from stillcut.engine.models.qwen3_5.config import LINEAR, Qwen35TextConfig, text_config
from stillcut.engine.models.qwen3_5.delta_net import GatedDeltaNet, stored_delta_net
from stillcut.engine.models.qwen3_5.mlp import (
    EXPERTS,
    SharedExpertMoE,
    SwiGLU,
    stored_shared_expert_moe,
    stored_swiglu,
)
from stillcut.engine.models.weights import Table, load_decoder, set_weight
from stillcut.engine.quantization import WeightFormat
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.stack import Block, Stack

UNUSED_PREFIXES = ("mtp.",)  # multi-token-prediction layers: transformers never loads them


def zero_centred(weight: torch.Tensor) -> nn.Parameter:
    """The scale `1 + w` of a zero-centred RMSNorm weight `w` (summed in float32, kept in
    `w`'s dtype)."""
    return nn.Parameter((1 + weight.float()).to(weight.dtype), requires_grad=False)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32, returned in `x`'s dtype."""
    return F.rms_norm(x.float(), x.shape[-1:], scale.float(), eps).to(x.dtype)


class Qwen35Layer(nn.Module):
    """One decoder layer: `hidden + mixer(norm(hidden))`, then `+ mlp(norm(...))`."""

    def __init__(self, stored: nn.Module, config: Qwen35TextConfig, layer_id: int) -> None:
        """From a checkpoint-named layer (`checkpoint_layout`)."""
        super().__init__()
        self.is_attention = config.layer_kinds[layer_id] != LINEAR
        self.mixer = (
            GatedAttention(stored.self_attn, config)
            if self.is_attention
            else GatedDeltaNet(stored.linear_attn, config, layer_id)
        )
        sparse = config.num_experts > 0
        self.mlp = (
            SharedExpertMoE(stored.mlp, config.num_experts_per_tok)
            if sparse
            else SwiGLU(stored.mlp)
        )
        self.input_layernorm = zero_centred(stored.input_layernorm.weight)
        self.post_attention_layernorm = zero_centred(stored.post_attention_layernorm.weight)
        self.eps = config.rms_norm_eps

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        """The residual stream `[N, hidden]` after this layer."""
        normed = rms_norm(hidden, self.input_layernorm, self.eps)
        if self.is_attention:
            hidden = self.mixer(normed, hidden, metadata, rotary, kv_cache)
        else:
            hidden = self.mixer(normed, hidden, metadata)
        return self.mlp(rms_norm(hidden, self.post_attention_layernorm, self.eps), hidden)

    def prepare_projections(self, arithmetic: torch.dtype | None = None) -> None:
        """Prepare the mixer's and the MLP's projections (`ProjectingModule`)."""
        self.mixer.prepare_projections(arithmetic)
        self.mlp.prepare_projections(arithmetic)


class Qwen35LanguageModel(PagedLanguageModel):
    """Qwen3.5 (or Qwen3.5-MoE) over a flat batch of tokens; build with `from_checkpoint`.

    As Qwen2's model, a tied model holds its embedding only as `lm_head` `[hidden, vocab]`
    (`embed_tokens` None), an untied one both; int8 tables have their `*_scale` beside them.
    """

    num_position_rows = 3  # M-RoPE: temporal, height, width
    bidirectional_item_tokens = 0  # every item is causal
    embed = Qwen2LanguageModel.embed
    prompt_positions = Qwen2LanguageModel.prompt_positions
    extend_positions = Qwen2LanguageModel.extend_positions

    def __init__(
        self,
        config: Qwen35TextConfig,
        rope_spec: MRopeSpec,
        layers: Sequence[Qwen35Layer],
        embed_tokens: Table | None,
        lm_head: Table,
        final_norm: torch.Tensor,
    ) -> None:
        """`embed_tokens` and `lm_head` (`head_layout`) each with its int8 scales (or None);
        `embed_tokens` None: the tied head is the table."""
        super().__init__()
        self.config = config
        self.rope_spec = rope_spec
        self.layers = nn.ModuleList(layers)
        self.embed_tokens = None
        if embed_tokens is not None:
            set_weight(self, "embed_tokens", *embed_tokens)
        set_weight(self, "lm_head", *lm_head)
        self.norm = zero_centred(final_norm)
        self.rotary = PartialMRoPE(config, final_norm.device)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over input embeddings `hidden` [N, hidden] -> final-normed [N, hidden].

        `positions` [3, N] are M-RoPE (t, h, w) positions; `kv_caches` one paged K/V tensor
        per attention layer, in layer order; `metadata.recurrent` the DeltaNet layers' states.
        """
        rotary = self.rotary(positions, hidden.dtype)  # cos, sin [N, 1, D]
        caches = iter(kv_caches)
        for layer in self.layers:
            hidden = layer(hidden, rotary, metadata, next(caches) if layer.is_attention else None)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def native_stack(self) -> Stack | None:
        """Each layer as two blocks for the native CPU decode step: its mixer (a `GatedDelta`,
        or gated attention whose partial rotary is the full-width table of `PartialMRoPE`) and
        its MLP (SwiGLU, or the softmax-routed `SoftmaxMoe` with its gated shared expert); the
        embedding is the tied head's rows when there is no table of its own."""
        blocks, num_caches = [], 0  # attention blocks take the step's K/V caches in order
        for layer in self.layers:
            mixer = layer.mixer
            native = mixer.native_mixer(num_caches) if layer.is_attention else mixer.native_mixer()
            blocks.append(Block(layer.input_layernorm, native))
            blocks.append(Block(layer.post_attention_layernorm, layer.mlp.native_mixer()))
            num_caches += layer.is_attention
        return self.tables_stack(
            blocks, [self.rotary.inv_freq], self.rotary.section, self.config.rms_norm_eps
        )

    @classmethod
    def from_checkpoint(
        cls,
        path: CheckpointLike,
        weight_format: WeightFormat = WeightFormat(),
        device: torch.device | str = "cpu",
    ) -> Qwen35LanguageModel:
        """The language model of a Qwen3.5 checkpoint folder (or hub id), its weights stored
        as `weight_format` says (default: as the checkpoint stores them).

        Loads `language_model.*` and the head strictly (`load_decoder`): missing, unexpected
        or misshapen tensors raise CheckpointError; `mtp.*` tensors are skipped (logged). The
        routed experts stay in the compute dtype.
        """
        checkpoint = open_checkpoint(path)
        model_config = checkpoint.config
        config = text_config(model_config)
        weight_format = weight_format.resolved(checkpoint_dtype(checkpoint))
        stored = checkpoint_layout(config)
        embed_tokens, lm_head = load_decoder(
            stored,
            checkpoint,
            weight_format,
            device,
            table="embed_tokens",
            tied=config.tie_word_embeddings,
            unused=UNUSED_PREFIXES,
            kept=EXPERTS,
        )
        layers = [Qwen35Layer(stored.layers[i], config, i) for i in range(config.num_layers)]
        rope_spec = MRopeSpec(
            model_config.image_token_id,
            model_config.video_token_id,
            tokens_per_second=model_config.vision.tokens_per_second,
        )
        model = cls(config, rope_spec, layers, embed_tokens, lm_head, stored.norm.weight)
        model.weight_format = weight_format
        model.prepare_weights()
        return model.eval()


def checkpoint_layout(config: Qwen35TextConfig) -> nn.Module:
    """Meta-device modules named like a checkpoint's `language_model.*` tensors."""
    with torch.device("meta"):
        root = nn.Module()
        root.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        root.layers = nn.ModuleList()
        for kind in config.layer_kinds:
            layer = nn.Module()
            if kind == LINEAR:
                layer.linear_attn = stored_delta_net(config)
            else:
                layer.self_attn = stored_attention(config)
            layer.mlp = (
                stored_shared_expert_moe(config)
                if config.num_experts
                else stored_swiglu(config.hidden_size, config.intermediate_size)
            )
            layer.input_layernorm = nn.RMSNorm(config.hidden_size)
            layer.post_attention_layernorm = nn.RMSNorm(config.hidden_size)
            root.layers.append(layer)
        root.norm = nn.RMSNorm(config.hidden_size)
    return root
