"""The runner's per-step inputs: persistent on the model's device, staged on the host.

DESIGN.md's step contract: token ids, positions, slot mapping, query starts, sequence lengths,
a zero-padded block table, the rows that sample and where multimodal embeddings go (a token
mask and the bidirectional item ranges) live in buffers sized once, so a step's
tensors are views of the same storage every step and a decode step can be replayed as a CUDA
graph. The host writes a step into one staging buffer (pinned on CUDA) and one copy moves it to
the device; on CPU the staging buffer is the device buffer and nothing is copied. The fields
lie back to back in one byte buffer, the block table last, so the copy stops after the block
table rows the step uses. A step of decodes may be padded to a bucket (`stage_pads`): each pad
row is a one-token request at position 0 of a sink block no request owns.

The host writes a step through numpy views of the staging buffer (`host_arrays`): a few values
from Python lists cost a fraction of a torch op each, and a decode step is mostly such writes.
The device views a step hands on are made once per row count (`token_views`,
`request_views`), not per step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from stillcut.kernels.attention_metadata import AttentionMetadata

_ALIGN = 8  # bytes: every field starts where an int64 may
# Row counts up to this get their device views made once and kept (decode steps and short
# chunks: steps whose host time matters); longer chunks slice the buffers anew.
_KEPT_VIEWS = 256


class StepTensors(NamedTuple):
    """One side's views (host staging or device) of the step buffers."""

    input_ids: torch.Tensor  # [max_num_tokens] long
    positions: torch.Tensor  # [num_position_rows, max_num_tokens] long
    slot_mapping: torch.Tensor  # [max_num_tokens] long
    sample_index: torch.Tensor  # [max_num_tokens] long, rows whose hidden state samples
    mm_mask: torch.Tensor  # [max_num_tokens] bool, rows that take a multimodal embedding
    mm_ranges: torch.Tensor  # [max_num_tokens, 3] int32, bidirectional items (b, start, end)
    query_start_loc: torch.Tensor  # [max_num_reqs + 1] int32
    seq_lens: torch.Tensor  # [max_num_reqs] int32
    block_tables: torch.Tensor  # [max_num_reqs, max_num_blocks] int32, zero past each row's


class StepBuffers:
    """Host staging and device views of a step's inputs, with the one copy between them."""

    def __init__(
        self,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_num_blocks: int,
        num_position_rows: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        long, int32 = torch.long, torch.int32
        layout = [  # (dtype, shape) in `StepTensors` order
            (long, (max_num_tokens,)),
            (long, (num_position_rows, max_num_tokens)),
            (long, (max_num_tokens,)),
            (long, (max_num_tokens,)),
            (torch.bool, (max_num_tokens,)),
            (int32, (max_num_tokens, 3)),
            (int32, (max_num_reqs + 1,)),
            (int32, (max_num_reqs,)),
            (int32, (max_num_reqs, max_num_blocks)),
        ]
        offsets, end = [], 0
        for dtype, shape in layout:
            offsets.append(end)
            size = math.prod(shape) * dtype.itemsize
            end += -(-size // _ALIGN) * _ALIGN
        self._row_bytes = max_num_blocks * int32.itemsize
        self._table_offset = offsets[-1]
        on_cuda = device.type == "cuda"
        self._host_bytes = torch.zeros(end, dtype=torch.uint8, pin_memory=on_cuda)
        self._device_bytes = (
            torch.zeros(end, dtype=torch.uint8, device=device) if on_cuda else self._host_bytes
        )
        self.host = _views(self._host_bytes, layout, offsets)
        # the same staging storage as numpy arrays (`StepTensors` of arrays), written by the host
        self.host_arrays = StepTensors(*(view.numpy() for view in self.host))
        self.device = _views(self._device_bytes, layout, offsets)
        self._token_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._request_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._copied = torch.cuda.Event() if on_cuda else None
        self.block_size = block_size
        self._table_width = 0  # block-table columns ever staged: rewritten in every staged row

    def staging(self) -> StepTensors:
        """The host views, once the previous step's copy has read them."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

    def stage_requests(
        self,
        query_start: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        rows: list[int],
        max_blocks: int,
        sample_index: list[int] | None,
    ) -> None:
        """Stage the per-request inputs (token inputs are staged already): `rows` of the
        runner's `block_table` `[max_num_reqs, max_num_blocks]` (zero past each row's blocks,
        at most `max_blocks`; a numpy array) go to the first rows, then the step is copied to
        the device."""
        num_requests, host = len(seq_lens), self.host_arrays
        host.query_start_loc[: num_requests + 1] = query_start
        host.seq_lens[:num_requests] = seq_lens
        self._table_width = max(self._table_width, max_blocks)
        width = self._table_width  # overwrites what longer requests left in these rows
        host.block_tables[: len(rows), :width] = block_table[rows, :width]
        if sample_index is not None:
            host.sample_index[: len(sample_index)] = sample_index
        self.upload(num_requests)

    def stage_items(
        self, num_tokens: int, spans: list[tuple[int, int]], ranges: list[tuple[int, int, int]]
    ) -> None:
        """Stage which of the step's `num_tokens` rows take multimodal embeddings (half-open
        `spans`) and its bidirectional item `ranges` (b, start, end); before `stage_requests`."""
        mask = self.host.mm_mask[:num_tokens]
        mask.zero_()
        for lo, hi in spans:
            mask[lo:hi] = True
        if ranges:
            self.host.mm_ranges[: len(ranges)] = torch.tensor(ranges, dtype=torch.int32)

    def stage_pads(
        self, query_start: list[int], seq_lens: list[int], bucket: int, sink_block: int
    ) -> None:
        """Pad a step of decodes (one token per request, so token rows are request rows) to
        `bucket` rows: each pad writes and reads position 0 of `sink_block` (block table row
        [sink, 0, ...]). Extends `query_start` and `seq_lens` in place."""
        first, host = query_start[-1], self.host
        pads = slice(first, bucket)
        host.input_ids[pads] = 0
        host.positions[:, pads] = 0
        host.slot_mapping[pads] = sink_block * self.block_size
        host.block_tables[pads, : max(self._table_width, 1)] = 0
        host.block_tables[pads, 0] = sink_block
        query_start.extend(range(first + 1, bucket + 1))
        seq_lens.extend([1] * (bucket - first))

    def metadata(
        self, query_start: list[int], seq_lens: list[int], max_seq_len: int, num_ranges: int = 0
    ) -> AttentionMetadata:
        """The staged step's attention metadata (with its first `num_ranges` staged item
        ranges): views of the device buffers."""
        query_start_loc, seq_lens_view, block_tables = self.request_views(len(seq_lens))
        return AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_view,
            block_tables=block_tables,
            slot_mapping=self.token_views(query_start[-1])[2],
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:], strict=False)),
            max_seq_len=max_seq_len,
            mm_ranges=self.device.mm_ranges[:num_ranges] if num_ranges else None,
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
        )

    def token_views(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """The device's input ids, positions, slot mapping, sample index and multimodal mask
        of a step's first `num_tokens` rows."""
        views = self._token_views.get(num_tokens)
        if views is None:
            device, n = self.device, num_tokens
            views = (
                device.input_ids[:n],
                device.positions[:, :n],
                device.slot_mapping[:n],
                device.sample_index[:n],
                device.mm_mask[:n],
            )
            if num_tokens <= _KEPT_VIEWS:
                self._token_views[num_tokens] = views
        return views

    def request_views(self, num_requests: int) -> tuple[torch.Tensor, ...]:
        """The device's query starts, sequence lengths and block table rows of a step's first
        `num_requests` requests."""
        views = self._request_views.get(num_requests)
        if views is None:
            device, n = self.device, num_requests
            views = (device.query_start_loc[: n + 1], device.seq_lens[:n], device.block_tables[:n])
            if num_requests <= _KEPT_VIEWS:
                self._request_views[num_requests] = views
        return views

    def upload(self, num_table_rows: int) -> None:
        """Copy the staged step to the device: everything up to the end of block table row
        `num_table_rows` (one asynchronous copy from pinned memory; nothing on CPU)."""
        if self._copied is None:
            return
        end = self._table_offset + num_table_rows * self._row_bytes
        self._device_bytes[:end].copy_(self._host_bytes[:end], non_blocking=True)
        self._copied.record()


def _views(buffer: torch.Tensor, layout, offsets: list[int]) -> StepTensors:
    """Typed views of `buffer` [bytes] for each (dtype, shape) of `layout` at its offset."""
    views = []
    for (dtype, shape), offset in zip(layout, offsets, strict=True):
        size = math.prod(shape) * dtype.itemsize
        views.append(buffer[offset : offset + size].view(dtype).view(shape))
    return StepTensors(*views)
