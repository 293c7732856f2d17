"""The runner's input preparation: a step's scheduled tokens gathered from the request rows.

Only what the scheduler asked for is gathered, into the runner's persistent step buffers
(`StepBuffers`: staged on the host, one copy to the device). A decode's token id, position and
slot are Python ints, written for all decodes at once; a chunk's come from the row's tensors.
Item embeddings (and the extra feature sets the model consumes) of the item tokens a step
computes are gathered beside them, with the bidirectional ranges the attention must honour. A
step of one-token rows that all sample is padded to a decode bucket (pad rows write to the sink
block), so a captured CUDA graph can replay it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from stillcut.engine.cuda_graphs import bucket_for
from stillcut.engine.scheduler_output import SchedulerOutput
from stillcut.kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from stillcut.engine.runner import ModelRunner, RowState


def prepare_inputs(runner: ModelRunner, output: SchedulerOutput) -> StepBatch:
    """Gather the scheduled tokens of `output` into the runner's step buffers: ids,
    positions, slots, item embeddings, attention and recurrent metadata, and which rows sample."""
    request_ids = list(output.num_scheduled_tokens)
    runner.buffers.staging()  # the previous step's copy has read the staging buffer
    computed = {c.request_id: c.num_computed_tokens for c in output.scheduled_cached}
    computed.update({n.request_id: n.num_computed_tokens for n in output.scheduled_new})
    query_start = [0]
    seq_lens, rows = [], []
    items = StepItems({name: [] for name in runner.feature_names})
    sample_ids, sample_index = [], []
    decodes: list[tuple[int, int, int, int]] = []  # (row in the batch, id, position, slot)
    size, max_blocks = runner.block_size, 0
    for request_id in request_ids:
        state = runner.rows[request_id]
        start = computed[request_id]
        end = start + output.num_scheduled_tokens[request_id]
        q0, q1 = query_start[-1], query_start[-1] + end - start
        drafts = output.spec_token_ids.get(request_id, ())
        if drafts:  # scored after the last sampled token; overwritten unless accepted
            runner.token_array[state.row, end - len(drafts) : end] = drafts
        if end - start == 1 and start >= state.prompt_len:
            # one sampled token: its values are Python ints, written for all decodes at once
            after = start - state.prompt_len
            slot = state.block_ids[start // size] * size + start % size
            decodes.append((q0, state.output_ids[after], state.next_position + after, slot))
        else:
            runner.input_ids[q0:q1] = runner.token_ids[state.row, start:end]
            runner.positions[:, q0:q1] = _positions(state, start, end)
            token_index = torch.arange(start, end)
            blocks = runner.block_table[state.row, token_index // size].long()
            runner.slot_mapping[q0:q1] = blocks * size + token_index % size
            meta_row = len(seq_lens)  # this request's row in the attention metadata
            _gather_items(state, start, end, q0, meta_row, items)
        if drafts:
            # a verify step is 1 + K one-token rows of the request, each seeing the ones
            # before it: a step of decodes (the native step takes it), causal inside
            query_start.extend(range(q0 + 1, q1 + 1))
            seq_lens.extend(range(start + 1, end + 1))
            rows.extend([state.row] * (end - start))
        else:
            query_start.append(q1)
            seq_lens.append(end)
            rows.append(state.row)
        max_blocks = max(max_blocks, len(state.block_ids))
        if end == state.num_tokens + len(drafts) and not state.hold:
            sample_ids.append(request_id)
            sample_index.extend(range(q1 - 1 - len(drafts), q1))
    if decodes:
        _write_decodes(runner, decodes)
    recurrent = runner.recurrent.metadata(output, request_ids, computed, runner.rows)
    every_token_samples = len(sample_index) == query_start[-1]  # a step of decodes only
    bucket = None
    if every_token_samples and len(seq_lens) == query_start[-1] and recurrent is None:
        # one-token rows that all sample (decodes, verify rows): padded to a bucket of rows
        bucket = bucket_for(len(seq_lens), runner.decode_buckets)
    if items.embeds:
        runner.buffers.stage_items(query_start[-1], items.spans, items.ranges)
    if bucket is not None:
        runner.buffers.stage_pads(query_start, seq_lens, bucket, runner.sink_block)
    runner.buffers.stage_requests(
        query_start,
        seq_lens,
        runner.block_array,
        rows,
        max_blocks,
        None if every_token_samples else sample_index,
    )
    metadata = runner.buffers.metadata(query_start, seq_lens, max(seq_lens), len(items.ranges))
    metadata.recurrent = recurrent
    metadata.prefill_dtype = runner.model.prefill_dtype
    input_ids, positions, _, _, mm_mask = runner.buffers.token_views(query_start[-1])
    return StepBatch(
        input_ids=input_ids,
        positions=positions,
        metadata=metadata,
        mm_embeds=torch.cat(items.embeds).to(runner.device) if items.embeds else None,
        mm_mask=mm_mask if items.embeds else None,
        mm_features=items.feature_tensors(runner.device),
        sample_ids=sample_ids,
        sample_index=(
            None if every_token_samples else runner.buffers.token_views(len(sample_index))[3]
        ),
        num_sampled=len(sample_index),
        bucket=bucket,
    )


def _write_decodes(runner: ModelRunner, decodes: list[tuple[int, int, int, int]]) -> None:
    """Token id, position and slot of each decode: one sampled text token (t = h = w)."""
    batch_rows, ids, positions, slots = zip(*decodes, strict=True)
    host = runner.buffers.host_arrays
    if batch_rows[-1] == len(batch_rows) - 1:  # decodes are scheduled first: rows 0..D-1
        batch_rows = slice(0, len(batch_rows))
    else:
        batch_rows = list(batch_rows)
    host.input_ids[batch_rows] = ids
    host.positions[:, batch_rows] = positions
    host.slot_mapping[batch_rows] = slots


def _positions(state: RowState, start: int, end: int) -> torch.Tensor:
    """Positions of tokens [start, end): the prompt's from its table, later ones count on."""
    split = min(max(start, state.prompt_len), end)
    prompt_part = state.positions[:, start:split]
    after = torch.arange(split, end) - state.prompt_len + state.next_position
    return torch.cat([prompt_part, after.expand(prompt_part.shape[0], -1)], dim=1)


def _gather_items(state: RowState, start: int, end: int, q0: int, b: int, items: StepItems) -> None:
    """Into `items`: embeddings (and consumed feature sets) of item tokens in [start, end),
    the batch spans they fill, and the bidirectional ranges to honour (at any step:
    appended input may follow decodes)."""
    # placements are sorted and disjoint: the overlapping ones start at the first ending after
    first = bisect.bisect_right(state.placements, start, key=lambda p: p.end)
    for index in range(first, len(state.placements)):
        item, place = state.items[index], state.placements[index]
        if place.offset >= end:
            break
        lo, hi = max(start, place.offset), min(end, place.end)
        rows = slice(lo - place.offset, hi - place.offset)
        items.embeds.append(item.embeds[rows])
        for name, pieces in items.features.items():
            pieces.append(item.features[name][rows])
        items.spans.append((q0 + lo - start, q0 + hi - start))
        if item.bidirectional:
            items.ranges.append((b, place.offset, place.end))


@dataclass
class StepItems:
    """The item tokens one step computes, gathered request by request."""

    features: dict[str, list[torch.Tensor]]  # name -> its rows of them, beside `embeds`
    embeds: list[torch.Tensor] = field(default_factory=list)  # [rows, hidden] pieces
    spans: list[tuple[int, int]] = field(default_factory=list)  # batch rows each piece fills
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # bidirectional ones

    def feature_tensors(self, device: torch.device) -> dict[str, torch.Tensor] | None:
        """Name -> [M, width] on `device`; None when no feature set is consumed or no item
        token runs in this step."""
        if not self.features or not self.embeds:
            return None
        return {name: torch.cat(pieces).to(device) for name, pieces in self.features.items()}


@dataclass
class StepBatch:
    """One step's inputs to the model, on its device, and which hidden rows sample."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [num_position_rows, N]
    metadata: AttentionMetadata
    mm_embeds: torch.Tensor | None  # [M, hidden]
    mm_mask: torch.Tensor | None  # [N] bool
    mm_features: dict[str, torch.Tensor] | None  # name -> [M, width]; None: no sets consumed
    sample_ids: list[str]
    sample_index: torch.Tensor | None  # [S]; None when every token samples
    num_sampled: int  # S: rows whose hidden state samples (1 + K for a verifying request)
    bucket: int | None = None  # decode rows padded to this many; None: not padded
