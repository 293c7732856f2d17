"""What one step tells every attention layer: where each request's queries and keys are.

Built by the runner once per step; read by both attention backends (`attention`'s torch one
and `paged_attention_triton`) and by recurrent layers (`recurrent`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stillcut.kernels.mamba2 import RecurrentMetadata


@dataclass
class AttentionMetadata:
    """Built by the runner once per step; shared by every layer.

    `mm_ranges` rows are `(request index b, start, end)` in sequence positions of request b;
    the items of one request must not overlap, and the runner never splits one across chunks.
    The `*_cpu` lists are host copies that spare the torch backend device syncs.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query tokens per request
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [N] int64, block_id * block_size + offset of each new token
    max_query_len: int
    max_seq_len: int
    mm_ranges: torch.Tensor | None = None  # [R, 3] int32 (b, start, end), or None
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # For models with recurrent layers: each request's state row and whether it starts fresh.
    recurrent: RecurrentMetadata | None = None
    # The dtype CPU prefill chunks longer than `attention.LONG_QUERY_ROWS` attend in (the model's
    # arithmetic, `engine.arithmetic`); None: float32.
    prefill_dtype: torch.dtype | None = None
    # What the torch backend derives from this metadata once and every layer reuses: each
    # request's bidirectional items ("items"), and per window and cache shape the decode batch
    # and the prefill chunks.
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_requests = self.seq_lens.shape[0]
        assert self.query_start_loc.shape == (num_requests + 1,), self.query_start_loc.shape
        assert self.block_tables.dim() == 2 and self.block_tables.shape[0] == num_requests
        assert self.slot_mapping.dim() == 1, self.slot_mapping.shape
        assert self.mm_ranges is None or self.mm_ranges.shape[1:] == (3,), self.mm_ranges.shape
