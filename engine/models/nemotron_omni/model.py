"""The NemotronH language model of Nemotron 3 Nano Omni, for the runner's flat token batches.

A stack of Mamba2, attention, MoE and MLP blocks (`nemotron_mamba`, `nemotron_blocks`,
`nemotron_moe`) between an embedding and a final RMSNorm. Attention layers take the runner's
paged K/V caches in layer order; Mamba2 layers read and write the runner's recurrent states
through `metadata.recurrent`. Positions play no part (no rotary anywhere), so the position row
the runner passes is ignored. On CPU a step of decodes runs as one native call (`native_stack`:
each block as its kind for `kernels/cpu`). Weights load as the checkpoint stores them
(release layout: `backbone.layers.{i}.mixer.*`, one tensor per expert) and are rearranged once
into `[in, out]` matrices; multi-token-prediction tensors, if any, are skipped as transformers
skips them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from stillcut.engine.checkpoint import CheckpointLike, open_checkpoint
from stillcut.engine.loader import checkpoint_dtype
from stillcut.engine.models.base import PagedLanguageModel
from stillcut.engine.models.matmul import head_table, scale_of
from stillcut.engine.models.nemotron_omni.blocks import (
    AttentionBlock,
    MLPBlock,
    NemotronBlock,
    frozen,
    rms_norm,
    stored_attention,
    stored_mlp,
)
from stillcut.engine.models.nemotron_omni.mamba import Mamba2Block, stored_mamba
from stillcut.engine.models.nemotron_omni.moe import MoEBlock, stored_moe
from stillcut.engine.models.nemotron_omni.text_config import (
    ATTENTION,
    MAMBA,
    MLP,
    MOE,
    NemotronTextConfig,
    nemotron_text_config,
)
from stillcut.engine.models.weights import embedding_rows, load_decoder, set_weight
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.quantization import WeightFormat
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.stack import Block, Stack

UNUSED_PREFIXES = ("mtp.",)  # multi-token-prediction layers: transformers never loads them


class NemotronHLanguageModel(PagedLanguageModel):
    """NemotronH over a flat batch of tokens; build with `from_checkpoint`.

    The head is `[hidden, vocab]` contiguous; a tied model without a stored head gathers its
    embeddings from the head's columns (`embeddings` is None). Int8 tables come with their
    per-row scales (`embeddings_scale`, `lm_head_scale`).
    """

    num_position_rows = 1  # the runner's positions are unused: no rotary embedding
    bidirectional_item_tokens = 0  # every item is causal

    def __init__(
        self,
        config: NemotronTextConfig,
        blocks: Sequence[NemotronBlock],
        embeddings: tuple[torch.Tensor, torch.Tensor | None] | None,
        final_norm: torch.Tensor,
        lm_head: tuple[torch.Tensor, torch.Tensor | None],
    ) -> None:
        """`embeddings` and `lm_head` are each a table and its int8 scales (or None)."""
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(blocks)
        self.embeddings = None
        if embeddings is not None:
            set_weight(self, "embeddings", *embeddings)
        self.norm = frozen(final_norm)
        set_weight(self, "lm_head", *lm_head)
        self.prepare_weights()

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over input embeddings `hidden` [N, hidden] -> final-normed [N, hidden].

        `kv_caches` holds one paged K/V tensor per attention layer, in layer order;
        `metadata.recurrent` the Mamba2 layers' states.
        """
        caches = iter(kv_caches)
        for block in self.layers:
            kv_cache = next(caches) if isinstance(block, AttentionBlock) else None
            hidden = block(hidden, metadata, kv_cache)
        return rms_norm(hidden, self.norm, self.config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings in the compute dtype: [N] ids -> [N, hidden]."""
        name = "lm_head" if self.embeddings is None else "embeddings"
        table = head_table(self.lm_head) if self.embeddings is None else self.embeddings
        return embedding_rows(input_ids, table, scale_of(self, name), self.norm.dtype)

    def native_stack(self) -> Stack:
        """Each layer as one block of its kind for the native CPU decode step (attention
        without rotary: no tables); the embedding is the tied head's rows when there is no
        table of its own."""
        blocks, num_caches = [], 0  # attention blocks take the step's K/V caches in order
        for block in self.layers:
            blocks.append(Block(block.norm, block.native_mixer(num_caches)))
            num_caches += isinstance(block, AttentionBlock)
        no_rotary = torch.zeros(0, dtype=torch.int64)
        return self.tables_stack(
            blocks, [], no_rotary, self.config.layer_norm_epsilon, table="embeddings"
        )

    def prompt_positions(
        self,
        token_ids: torch.Tensor,
        items: Sequence[MultiModalItem],
        placements: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Plain positions [1, prompt_len] (unused by the layers) and the next one."""
        num_tokens = token_ids.shape[0]
        return torch.arange(num_tokens)[None], num_tokens

    @classmethod
    def from_checkpoint(
        cls,
        path: CheckpointLike,
        weight_format: WeightFormat = WeightFormat(),
        device: torch.device | str = "cpu",
    ) -> NemotronHLanguageModel:
        """The language model of a Nemotron 3 Nano Omni checkpoint folder (or hub id), its
        weights stored as `weight_format` says (default: as the checkpoint stores them).

        Loads `language_model.*` and the head strictly through the shared loader: missing,
        unexpected or misshapen tensors raise CheckpointError. A tied checkpoint that stores no
        head uses its embedding as the head. The MoE routers are float32 whatever the format.
        """
        checkpoint = open_checkpoint(path)
        model_config = checkpoint.config
        config = nemotron_text_config(model_config)
        weight_format = weight_format.resolved(checkpoint_dtype(checkpoint))
        stored = _checkpoint_layout(config)
        embeddings, lm_head = load_decoder(
            stored,
            checkpoint,
            weight_format,
            device,
            table="embeddings",
            tied=config.tie_word_embeddings,
            unused=UNUSED_PREFIXES,
        )
        blocks = [_block(stored.layers[i], config, i) for i in range(config.num_layers)]
        model = cls(config, blocks, embeddings, stored.norm_f.weight, lm_head)
        model.weight_format = weight_format
        return model.eval()


def _block(stored: nn.Module, config: NemotronTextConfig, layer_id: int) -> NemotronBlock:
    kind = config.layer_kinds[layer_id]
    if kind == MAMBA:
        return Mamba2Block(stored, config, layer_id)
    return {ATTENTION: AttentionBlock, MOE: MoEBlock, MLP: MLPBlock}[kind](stored, config)


def _checkpoint_layout(config: NemotronTextConfig) -> nn.Module:
    """Meta-device modules named like a checkpoint's `language_model.*` tensors."""
    mixers = {
        MAMBA: lambda: stored_mamba(config),
        ATTENTION: lambda: stored_attention(config),
        MOE: lambda: stored_moe(config),
        MLP: lambda: stored_mlp(config.hidden_size, config.intermediate_size, config.mlp_bias),
    }
    with torch.device("meta"):
        root = nn.Module()
        root.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        root.layers = nn.ModuleList()
        for kind in config.layer_kinds:
            block = nn.Module()
            block.norm = nn.RMSNorm(config.hidden_size)
            block.mixer = mixers[kind]()
            root.layers.append(block)
        root.norm_f = nn.RMSNorm(config.hidden_size)
    return root
