"""The runner's per-step inputs: persistent on the model's device, staged on the host.

DESIGN.md's step contract: token ids, positions, slot mapping, query starts, sequence lengths,
a zero-padded block table and the rows that sample live in buffers sized once, so a step's
tensors are views of the same storage every step and a decode step can be replayed as a CUDA
graph. The host writes a step into one staging buffer (pinned on CUDA) and one copy moves it to
the device; on CPU the staging buffer is the device buffer and nothing is copied. The fields
lie back to back in one byte buffer, the block table last, so the copy stops after the block
table rows the step uses.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

_ALIGN = 8  # bytes: every field starts where an int64 may


class StepTensors(NamedTuple):
    """One side's views (host staging or device) of the step buffers."""

    input_ids: torch.Tensor  # [max_num_tokens] long
    positions: torch.Tensor  # [num_position_rows, max_num_tokens] long
    slot_mapping: torch.Tensor  # [max_num_tokens] long
    sample_index: torch.Tensor  # [max_num_tokens] long, rows whose hidden state samples
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
        device: torch.device,
    ) -> None:
        long, int32 = torch.long, torch.int32
        layout = [
            (long, (max_num_tokens,)),
            (long, (num_position_rows, max_num_tokens)),
            (long, (max_num_tokens,)),
            (long, (max_num_tokens,)),
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
        self.device = _views(self._device_bytes, layout, offsets)
        self._copied = torch.cuda.Event() if on_cuda else None

    def staging(self) -> StepTensors:
        """The host views, once the previous step's copy has read them."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.host

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
