"""What the runner asks of every language model: `PagedLanguageModel`, and the 1-D position
cursor of the families whose positions count up with the sequence.

Each model runs a flat batch of N tokens per step over its caches and keeps its own specifics
(weight layout, positions) in its family's folder; the runner calls `forward`,
`compute_logits`, `prompt_positions` and `extend_positions`. A forward first offers the step to
the native CPU decode step (`native_decode`), which also checks that the weights are those its
prepared matrices were made from.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stillcut.engine.models.matmul import (
    StoredMatrix,
    head_table,
    prepare_matrices,
    scale_of,
    vocab_logits,
)
from stillcut.engine.models.weight_snapshot import WeightSnapshot
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.quantization import WeightFormat
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu.decoder import CpuDecoder, bind
from stillcut.kernels.cpu.stack import Block, Stack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinearCursor:
    """Where 1-D positions stand after a sequence: a sequence appended after it has its own
    positions shifted by `next_position` (every family without M-RoPE)."""

    next_position: int = 0

    def after_decoded(self, num_tokens: int) -> LinearCursor:
        """The cursor after `num_tokens` generated tokens."""
        return LinearCursor(self.next_position + num_tokens)


class PagedLanguageModel(nn.Module):
    """What the runner asks of every language model: `forward` (shared here: the native decode
    step, or the model's `embed` and `run_layers`), `compute_logits`, `prompt_positions`,
    `extend_positions` (positions as a fold over appended input), its layer count and the
    shape of one layer's paged KV cache. `config` has `num_layers`,
    `num_kv_heads` and `head_dim`. `prepare_weights` (called by the model's
    `from_checkpoint`) makes what is derived from the weights: `head_matrices` and the layers'
    prepared projections (`prepare_matrices`), and `cpu_decoder`, the native CPU decode step,
    from `native_stack` where the kernel serves it. `weight_format` is how its weights are
    stored (`engine.quantization.WeightFormat`).

    A model whose tower gives extra feature sets (`MultiModalItem.features`) names the ones it
    consumes in `mm_feature_names`; then every step with `mm_embeds` also passes
    `mm_features`, name -> [M, width], row m of each the feature of the token `mm_embeds` row m
    is (so they sit at the rows `mm_mask` marks, in order): the features of exactly the item
    tokens this step computes, whether the step covers a whole item, part of one (a prefill
    chunk; a prefix-cache hit ending inside it) or input appended to a running request. A model
    naming none is never passed `mm_features`, and no step gathers any for it."""

    config: object
    mm_feature_names: tuple[str, ...] = ()
    head_matrices: tuple[StoredMatrix, StoredMatrix] | None = None
    weight_format: WeightFormat | None = None
    cpu_decoder: CpuDecoder | None = None  # None: the torch ops run (also set so by benches)
    weights_seen: WeightSnapshot | None = None  # the weights `prepare_weights` saw
    # (hidden states, their logits) of the last native step, made in the same call
    step_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def prefill_dtype(self) -> torch.dtype | None:
        """The arithmetic of long prefill batches, their products and attention
        (`engine.arithmetic`); None without a `weight_format`: their input's."""
        return None if self.weight_format is None else self.weight_format.product_dtype

    def extend_positions(
        self,
        cursor: LinearCursor | None,
        token_ids: torch.Tensor,
        items: Sequence[MultiModalItem],
        placements: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, LinearCursor]:
        """Positions of tokens appended after `cursor` (None: at a sequence's start) and the
        cursor after them; placements relative to `token_ids`. This default serves 1-D
        positions, which shift with the sequence before them; M-RoPE overrides it."""
        start = 0 if cursor is None else cursor.next_position
        positions, next_position = self.prompt_positions(token_ids, items, placements)
        return positions + start, LinearCursor(start + next_position)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        mm_embeds: torch.Tensor | None = None,
        mm_mask: torch.Tensor | None = None,
        mm_features: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [N] tokens -> [N, hidden].

        `positions` and `kv_caches` as the model's `run_layers` takes them. `mm_embeds`
        [M, hidden] replace the input embeddings of the M rows where `mm_mask` [N] is True. A
        step of decodes the native CPU step serves is one native call; else the model's
        `input_embeddings` go through its `run_layers`, which also takes `mm_mask` and
        `mm_features` when the step carries the feature sets the model names.
        """
        if (mm_embeds is None) != (mm_mask is None):
            raise ValueError("mm_embeds and mm_mask must be given together")
        native = self.native_decode(input_ids, positions, kv_caches, metadata, mm_embeds)
        if native is not None:
            return native  # a step of decodes, in one native call
        hidden = self.input_embeddings(input_ids)  # [N, hidden]
        if mm_embeds is not None:
            hidden[mm_mask] = mm_embeds.to(hidden.dtype)
        if mm_features is not None:
            features = {"mm_mask": mm_mask, "mm_features": mm_features}
            return self.run_layers(hidden, positions, kv_caches, metadata, **features)
        return self.run_layers(hidden, positions, kv_caches, metadata)

    def input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder's input for token ids: [N] -> [N, hidden]; by default `embed`'s rows."""
        return self.embed(input_ids)

    def native_stack(self) -> Stack | None:
        """The model as the native CPU decode step reads it; None: it has none."""
        return None

    def tables_stack(
        self,
        blocks: Sequence[Block],
        inv_freqs: Sequence[torch.Tensor],
        section: torch.Tensor,
        eps: float,
        table: str = "embed_tokens",
    ) -> Stack:
        """`blocks` between the model's token embedding (its attribute `table`; the tied head's
        rows where that is None) and its final norm `norm` and head `lm_head` (and their int8
        scales), with its rotary tables: a `native_stack`."""
        tied = getattr(self, table) is None
        return Stack(
            blocks,
            embedding=head_table(self.lm_head) if tied else getattr(self, table),
            embedding_scales=scale_of(self, "lm_head" if tied else table),
            final_norm=self.norm,
            inv_freqs=inv_freqs,
            section=section,
            eps=eps,
            head=self.lm_head,
            head_scales=scale_of(self, "lm_head"),
        )

    def prepare_weights(self) -> None:
        """Make the prepared matrices and the native decoder from the weights as they are
        now, and remember which tensors those were (see `native_decode`)."""
        prepare_matrices(self)
        stack = self.native_stack()
        self.cpu_decoder = None if stack is None else bind(stack)
        self.weights_seen = WeightSnapshot(self)

    def native_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        mm_embeds: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """`forward`'s result from the native CPU decode step when this step is one it takes
        (decodes only, see `CpuDecoder.supports`), else None. Every forward calls it first, so
        here the weights are checked: if the model now holds other tensors than the prepared
        matrices and the decoder were made from (a reload, `.to()`, a replaced parameter),
        both are made again before anything reads them (falling back to torch where the kernel
        cannot serve the new weights, e.g. float64). The native step computes its rows' logits
        in the same call, kept for `head_logits`."""
        self._keep_step_logits(None)
        if self.weights_seen is not None and not self.weights_seen.current():
            log.info("the model's weights changed: rebuilding its matrices and native decode step")
            self.prepare_weights()
        native = self.cpu_decoder
        if (
            mm_embeds is None
            and native is not None
            and native.supports(input_ids, kv_caches, metadata)
        ):
            hidden, logits = native.decode(input_ids, positions, kv_caches, metadata, True)
            if logits is not None:
                self._keep_step_logits((hidden, logits))
            return hidden
        return None

    def _keep_step_logits(self, made: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        # in the instance's dictionary directly: `nn.Module.__setattr__` checks each assignment
        # against parameters, buffers and submodules, a cost seen in every decode step
        vars(self)["step_logits"] = made

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits [S, vocab] of the rows that sample, from `forward`'s [S, hidden]."""
        return self.head_logits(hidden_states)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[S, vocab]` of `hidden` `[S, hidden]` through the LM head: those the
        native step made with `hidden` when `hidden` is the very tensor it returned (a step of
        decodes whose every row samples), else the head's product."""
        made = self.step_logits
        self._keep_step_logits(None)
        if made is not None and made[0] is hidden:
            return made[1]
        return vocab_logits(hidden, self.head_matrices or self.lm_head)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's KV cache: [2 (k, v), num_blocks, block_size, Hkv, D]."""
        return (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
