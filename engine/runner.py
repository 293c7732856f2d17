"""The model runner: persistent request rows in, sampled tokens out.

In the style of vLLM's Model Runner V2, each request the runner knows owns one row of
persistent tensors for its lifetime (token ids, block table) plus its position table, items and
sampling state. A step gathers only what the scheduler asked for into persistent input buffers
(`StepBuffers`: staged on the host, one copy to the device), builds the attention metadata once
(slot mapping, block tables, bidirectional item ranges), runs the model over the flat batch,
computes logits only for the requests that sample, and samples. With `decode_buckets`, a step
of one-token rows only (decodes, and verify steps: see below) is padded to the next bucket (pad
rows are one-token requests writing to a sink block of their own) and, once
`capture_decode_graphs` has run, replayed as that bucket's CUDA graph (`cuda_graphs`). Nothing
here is specific to one model: positions come from `model.extend_positions`, a fold over the
sequence whose cursor the row keeps, so input appended to a live request costs O(its tokens):
its ids, positions and items are added to the row, nothing is recomputed. The item tokens a
step computes are handed over as `mm_embeds` (and, to a model that names extra feature sets in
`mm_feature_names`, those sets' rows of the same tokens as `mm_features`: see
`PagedLanguageModel`). The caches are
allocated from the family's cache groups: one paged K/V tensor per attention layer (handed to
the model in layer order) and one recurrent state per row and recurrent layer (handed to it in
the step's `metadata.recurrent`, with each request's row and whether its state starts fresh),
beside the slots of recurrent-state snapshots: a request entering from a snapshot (a
prefix-cache hit) has its row's states copied from its slot, and the recurrent layers save
their states into the slots the step's captures name. A request with drafts
(`SchedulerOutput.spec_token_ids`) runs its last sampled token and its drafts, written into its
row after its tokens, as that many one-token rows of the attention metadata (so a verify step
is a step of decodes, which the native CPU step takes), and samples at each of them (see
`RowSampler.sample`); rejected drafts stay in the row until later tokens overwrite them. Its
recurrent states cannot be overwritten so: the verify step keeps them after each scored token,
and the request's next step restores those after its last accepted one (`_roll_back`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stillcut.engine.cache_groups import CacheGroup, attention_groups, recurrent_groups
from stillcut.engine.cuda_graphs import DecodeGraphs, bucket_for
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.request import PlaceholderRange, SamplingParams
from stillcut.engine.row_sampler import RowSampler, StepResult
from stillcut.engine.scheduler_output import AppendedInput, NewRequestData, SchedulerOutput
from stillcut.engine.step_buffers import StepBuffers
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.mamba2 import RecurrentMetadata


@dataclass
class RowState:
    """What the runner keeps for one request between steps (beside its tensor row)."""

    row: int
    prompt_len: int  # tokens placed by the model: the prompt and all appended input so far
    num_tokens: int  # tokens written into the row (prompt + sampled)
    positions: torch.Tensor  # [num_position_rows, >= prompt_len] long; grows by doubling
    cursor: object  # the model's position cursor after the first prompt_len tokens
    items: list[MultiModalItem]
    placements: list[PlaceholderRange]
    params: SamplingParams
    hold: bool
    output_ids: list[int] = field(default_factory=list)  # sampled since the last placement
    block_ids: list[int] = field(default_factory=list)  # the row of `block_table`, in Python

    @property
    def next_position(self) -> int:
        """Position of the first sampled token after the placed ones."""
        return self.cursor.next_position


class ModelRunner:
    """Runs one model over a paged KV cache for the scheduler's steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache_groups: Sequence[CacheGroup],
        *,
        num_blocks: int,
        block_size: int,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype | None = None,
        decode_buckets: Sequence[int] = (),
        num_state_snapshots: int = 0,
        max_spec_tokens: int = 0,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # Padded decode rows write their K/V into one extra block that no request owns.
        self.decode_buckets = tuple(decode_buckets)
        self.sink_block = num_blocks
        num_cache_blocks = num_blocks + (1 if self.decode_buckets else 0)
        self.kv_caches = _paged_kv_caches(
            cache_groups, num_cache_blocks, block_size, kv_dtype, device
        )
        # layer id -> its state tensors, each [max_num_reqs, *shape]: row r is request row r's
        state_dtype = state_dtype or kv_dtype
        self.recurrent_states = _recurrent_states(cache_groups, max_num_reqs, state_dtype, device)
        # layer id -> its snapshot tensors, each [num_state_snapshots, *shape]
        self.state_snapshots = _recurrent_states(
            cache_groups, num_state_snapshots, state_dtype, device
        )
        # layer id -> the states after each position of a verify step, each
        # [max_num_reqs * (1 + max_spec_tokens), *shape]: slot row * (1 + K) + j is row's after
        # its j-th scored token (see `_roll_back`)
        self.draft_stride = 1 + max_spec_tokens
        self.draft_states = _recurrent_states(
            cache_groups, max_num_reqs * self.draft_stride if max_spec_tokens else 0,
            state_dtype, device,
        )  # fmt: skip
        self._verified: dict[str, int] = {}  # request id -> where its last verify step started
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.long)
        self.block_table = torch.zeros(max_num_reqs, max_blocks, dtype=torch.int32)
        # numpy views of both: a step writes a few Python ints into them (cheaper than torch ops)
        self.token_array, self.block_array = self.token_ids.numpy(), self.block_table.numpy()
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.rows: dict[str, RowState] = {}
        # with speculation, seeded draws are keyed by output position (see `RowSampler`)
        self.sampling = RowSampler(self.device, keyed_draws=max_spec_tokens > 0)
        # a verifying request is 1 + K rows of the attention metadata
        max_meta_rows = min(max_num_reqs * (1 + max_spec_tokens), max_num_batched_tokens)
        assert max(self.decode_buckets, default=0) <= max(max_num_reqs, max_meta_rows)
        self.buffers = StepBuffers(
            max_num_tokens=max_num_batched_tokens,
            max_num_reqs=max(max_num_reqs, max_meta_rows),
            max_num_blocks=max_blocks,
            num_position_rows=model.num_position_rows,
            block_size=block_size,
            device=self.device,
        )
        # `_prepare` writes token inputs straight into the staging views.
        self.input_ids = self.buffers.host.input_ids
        self.positions = self.buffers.host.positions
        self.slot_mapping = self.buffers.host.slot_mapping
        # which scheduled tokens are prompt tokens (for recurrent layers), staged on the host
        self.prompt_mask = torch.zeros(max_num_batched_tokens, dtype=torch.bool)
        self.prompt_array = self.prompt_mask.numpy()
        self.graphs: DecodeGraphs | None = None
        # the items' extra feature sets the model consumes (admission checked every item
        # carries them); none: no step gathers any
        self.feature_names: tuple[str, ...] = tuple(model.mm_feature_names)

    def capture_decode_graphs(self) -> DecodeGraphs:
        """Capture one CUDA graph per decode bucket (see `cuda_graphs`); decodes then replay."""
        self.graphs = DecodeGraphs.capture(self)
        return self.graphs

    @property
    def num_kv_bytes(self) -> int:
        """Bytes of the paged K/V, the recurrent states and their snapshots."""
        states = [
            t
            for layers in (self.recurrent_states, self.state_snapshots)
            for layer in layers.values()
            for t in layer
        ]
        return sum(t.numel() * t.element_size() for t in [*self.kv_caches, *states])

    def execute(self, output: SchedulerOutput) -> StepResult:
        """Apply the scheduler's row changes, run the scheduled tokens, sample."""
        self._update_rows(output)
        if not output.num_scheduled_tokens:
            return StepResult({}, {})
        batch = self._prepare(output)
        with torch.inference_mode():
            if self.graphs is not None and batch.bucket in self.graphs.logits:
                logits = self.graphs.replay(batch.bucket)[: batch.num_sampled]
                return self._sample(batch.sample_ids, logits, output.spec_token_ids)
            hidden = self.model(
                batch.input_ids,
                batch.positions,
                self.kv_caches,
                batch.metadata,
                mm_embeds=batch.mm_embeds,
                mm_mask=batch.mm_mask,
                mm_features=batch.mm_features,
            )  # [N, hidden]
            if not batch.sample_ids:
                return StepResult({}, {})
            if batch.sample_index is not None:
                hidden = hidden[batch.sample_index]  # [S, hidden]
            elif batch.bucket is not None:
                hidden = hidden[: batch.num_sampled]  # [S, hidden]: the pad rows dropped
            logits = self.model.compute_logits(hidden)  # [S, vocab]
            return self._sample(batch.sample_ids, logits, output.spec_token_ids)

    # ---- rows ------------------------------------------------------------------------------

    def _update_rows(self, output: SchedulerOutput) -> None:
        for request_id in output.finished_ids:
            self._drop_row(request_id)
            self.sampling.forget(request_id)
        for request_id in output.preempted_ids:
            self._drop_row(request_id)
        for cached in output.scheduled_cached:
            self._roll_back(cached.request_id, cached.num_computed_tokens)
        for new in output.scheduled_new:
            assert new.request_id not in self.rows, "a request with a row is never new"
            self._add_row(new)
        for cached in output.scheduled_cached:
            state = self.rows[cached.request_id]
            for appended in cached.appended:
                self._append_input(state, appended)
            if cached.new_block_ids:
                self._append_blocks(state, cached.new_block_ids)

    def _add_row(self, new: NewRequestData) -> None:
        row = self.free_rows.pop()
        num_prompt = len(new.prompt_token_ids)
        prompt = torch.tensor(new.prompt_token_ids, dtype=torch.long)
        positions, cursor = self.model.extend_positions(
            None, prompt, new.mm_items, [tuple(p) for p in new.mm_positions]
        )
        all_ids = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(all_ids)] = torch.tensor(all_ids, dtype=torch.long)
        state = RowState(
            row=row,
            prompt_len=num_prompt,
            num_tokens=len(all_ids),
            positions=positions,
            cursor=cursor,
            items=list(new.mm_items),
            placements=list(new.mm_positions),
            params=new.sampling_params,
            hold=new.hold,
            output_ids=list(new.output_token_ids),
        )
        self.rows[new.request_id] = state
        self._append_blocks(state, new.block_ids)
        self.sampling.admit(new.request_id, new.sampling_params)
        if new.restore_slot is not None:
            # before this step's forward, which may save other states into the same slot
            for layer, states in self.recurrent_states.items():
                for tensor, snapshot in zip(states, self.state_snapshots[layer], strict=True):
                    tensor[row] = snapshot[new.restore_slot]

    def _append_input(self, state: RowState, appended: AppendedInput) -> None:
        """Write appended input into a row: the sampled tokens it follows become placed (at the
        positions they were computed at), then the model places the new tokens after them."""
        num_kept = appended.start - state.prompt_len  # sampled tokens kept before the input
        assert 0 <= num_kept <= len(state.output_ids), (appended.start, state.prompt_len)
        num_new = len(appended.token_ids)
        new_ids = torch.tensor(appended.token_ids, dtype=torch.long)
        offsets = [(p.offset - appended.start, p.length) for p in appended.mm_positions]
        kept = torch.arange(num_kept) + state.next_position  # [num_kept]
        cursor = state.cursor.after_decoded(num_kept) if num_kept else state.cursor
        positions, state.cursor = self.model.extend_positions(
            cursor, new_ids, appended.mm_items, offsets
        )
        self._place(state, torch.cat([kept.expand(positions.shape[0], -1), positions], dim=1))
        self.token_ids[state.row, appended.start : appended.start + num_new] = new_ids
        state.num_tokens = appended.start + num_new
        state.output_ids = []
        state.items.extend(appended.mm_items)
        state.placements.extend(appended.mm_positions)

    def _place(self, state: RowState, positions: torch.Tensor) -> None:
        """Add `positions` [rows, n] after the placed ones, doubling the table when full."""
        end = state.prompt_len + positions.shape[1]
        if end > state.positions.shape[1]:
            grown = state.positions.new_empty(state.positions.shape[0], 2 * end)
            grown[:, : state.prompt_len] = state.positions[:, : state.prompt_len]
            state.positions = grown
        state.positions[:, state.prompt_len : end] = positions
        state.prompt_len = end

    def rewrite_tokens(self, request_id: str, start: int, token_ids: Sequence[int]) -> None:
        """Make a row's tokens from `start` on `token_ids` (a draft model's mirror of a target
        request, rolled back where the target rejected its drafts). Their K/V is computed by
        the next step that schedules them."""
        state = self.rows[request_id]
        assert state.prompt_len <= start + len(token_ids), "a prompt is never rewritten"
        end = start + len(token_ids)
        self.token_ids[state.row, start:end] = torch.tensor(token_ids, dtype=torch.long)
        state.num_tokens = end
        state.output_ids = self.token_ids[state.row, state.prompt_len : end].tolist()

    def _append_blocks(self, state: RowState, block_ids: list[int]) -> None:
        start = len(state.block_ids)
        self.block_array[state.row, start : start + len(block_ids)] = block_ids
        state.block_ids.extend(block_ids)

    def _roll_back(self, request_id: str, num_computed: int) -> None:
        """A request whose last step verified drafts runs again with `num_computed` tokens
        computed (the scheduler rolled back those past the first rejected draft, or past a
        stop): its row's recurrent states become those after its last computed token, kept
        by the verify step (`RecurrentMetadata.verify_positions`). Per-position states cost
        (1 + K) states per row in memory, and writing them about as much as the update itself
        (each position's update rewrites the whole state anyway); recomputing the accepted
        tokens instead would cost another forward of the model."""
        start = self._verified.pop(request_id, None)
        if start is None or num_computed == start + self.draft_stride:
            return  # every scored token accepted: the row holds their states already
        slot = self.rows[request_id].row * self.draft_stride + num_computed - start - 1
        for layer, states in self.recurrent_states.items():
            for tensor, drafts in zip(states, self.draft_states[layer], strict=True):
                tensor[self.rows[request_id].row] = drafts[slot]

    def _drop_row(self, request_id: str) -> None:
        self._verified.pop(request_id, None)
        state = self.rows.pop(request_id, None)
        if state is not None:
            # the attention backends read a row's padding as block 0, never as someone else's
            self.block_table[state.row, : len(state.block_ids)] = 0
            self.free_rows.append(state.row)

    # ---- inputs ------------------------------------------------------------------------------

    def _prepare(self, output: SchedulerOutput) -> _Batch:
        request_ids = list(output.num_scheduled_tokens)
        self.buffers.staging()  # the previous step's copy has read the staging buffer
        computed = {c.request_id: c.num_computed_tokens for c in output.scheduled_cached}
        computed.update({n.request_id: n.num_computed_tokens for n in output.scheduled_new})
        query_start = [0]
        seq_lens, rows = [], []
        items = _StepItems({name: [] for name in self.feature_names})
        sample_ids, sample_index = [], []
        decodes: list[tuple[int, int, int, int]] = []  # (row in the batch, id, position, slot)
        size, max_blocks = self.block_size, 0
        for request_id in request_ids:
            state = self.rows[request_id]
            start = computed[request_id]
            end = start + output.num_scheduled_tokens[request_id]
            q0, q1 = query_start[-1], query_start[-1] + end - start
            drafts = output.spec_token_ids.get(request_id, ())
            if drafts:  # scored after the last sampled token; overwritten unless accepted
                self.token_array[state.row, end - len(drafts) : end] = drafts
            if end - start == 1 and start >= state.prompt_len:
                # one sampled token: its values are Python ints, written for all decodes at once
                after = start - state.prompt_len
                slot = state.block_ids[start // size] * size + start % size
                decodes.append((q0, state.output_ids[after], state.next_position + after, slot))
            else:
                self.input_ids[q0:q1] = self.token_ids[state.row, start:end]
                self.positions[:, q0:q1] = self._positions(state, start, end)
                token_index = torch.arange(start, end)
                blocks = self.block_table[state.row, token_index // size].long()
                self.slot_mapping[q0:q1] = blocks * size + token_index % size
                meta_row = len(seq_lens)  # this request's row in the attention metadata
                self._gather_items(state, start, end, q0, meta_row, items)
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
            self._write_decodes(decodes)
        recurrent = self._recurrent_metadata(output, request_ids, computed)
        every_token_samples = len(sample_index) == query_start[-1]  # a step of decodes only
        bucket = None
        if every_token_samples and len(seq_lens) == query_start[-1] and recurrent is None:
            # one-token rows that all sample (decodes, verify rows): padded to a bucket of rows
            bucket = bucket_for(len(seq_lens), self.decode_buckets)
        if items.embeds:
            self.buffers.stage_items(query_start[-1], items.spans, items.ranges)
        if bucket is not None:
            self.buffers.stage_pads(query_start, seq_lens, bucket, self.sink_block)
        self.buffers.stage_requests(
            query_start,
            seq_lens,
            self.block_array,
            rows,
            max_blocks,
            None if every_token_samples else sample_index,
        )
        metadata = self.buffers.metadata(query_start, seq_lens, max(seq_lens), len(items.ranges))
        metadata.recurrent = recurrent
        metadata.prefill_dtype = self.model.prefill_dtype
        input_ids, positions, _, _, mm_mask = self.buffers.token_views(query_start[-1])
        return _Batch(
            input_ids=input_ids,
            positions=positions,
            metadata=metadata,
            mm_embeds=torch.cat(items.embeds).to(self.device) if items.embeds else None,
            mm_mask=mm_mask if items.embeds else None,
            mm_features=items.feature_tensors(self.device),
            sample_ids=sample_ids,
            sample_index=(
                None if every_token_samples else self.buffers.token_views(len(sample_index))[3]
            ),
            num_sampled=len(sample_index),
            bucket=bucket,
        )

    def _write_decodes(self, decodes: list[tuple[int, int, int, int]]) -> None:
        """Token id, position and slot of each decode: one sampled text token (t = h = w)."""
        batch_rows, ids, positions, slots = zip(*decodes, strict=True)
        host = self.buffers.host_arrays
        if batch_rows[-1] == len(batch_rows) - 1:  # decodes are scheduled first: rows 0..D-1
            batch_rows = slice(0, len(batch_rows))
        else:
            batch_rows = list(batch_rows)
        host.input_ids[batch_rows] = ids
        host.positions[:, batch_rows] = positions
        host.slot_mapping[batch_rows] = slots

    def _recurrent_metadata(
        self, output: SchedulerOutput, request_ids: list[str], computed: dict[str, int]
    ) -> RecurrentMetadata | None:
        """Each request's state row, whether its state starts fresh (its first computed
        token is token 0: a new request, or one recomputed after preemption), which
        scheduled tokens are prompt tokens, where to save snapshots, and which requests verify
        drafts (their start is kept for `_roll_back`). None for a model without recurrent
        layers."""
        if not self.recurrent_states:
            return None
        # a request resuming after cached tokens had its state restored from a snapshot
        assert all(
            n.num_computed_tokens == 0 or n.restore_slot is not None for n in output.scheduled_new
        ), "a state resumed without a snapshot"
        scheduled = output.num_scheduled_tokens
        query_start = [0, *itertools.accumulate(scheduled[r] for r in request_ids)]
        prompt_token_mask = self.prompt_array[: query_start[-1]]
        prompt_token_mask[:] = False
        for b, request_id in enumerate(request_ids):
            # a request's prompt tokens come first among its scheduled ones
            num_prompt = max(self.rows[request_id].prompt_len - computed[request_id], 0)
            end = min(query_start[b] + num_prompt, query_start[b + 1])
            prompt_token_mask[query_start[b] : end] = True
        verifying = [bool(output.spec_token_ids.get(r)) for r in request_ids]
        for request_id, verifies in zip(request_ids, verifying, strict=True):
            if verifies:
                self._verified[request_id] = computed[request_id]
        return RecurrentMetadata(
            states=self.recurrent_states,
            state_rows_cpu=[self.rows[r].row for r in request_ids],
            fresh=[computed[r] == 0 for r in request_ids],
            query_start_loc_cpu=query_start,
            prompt_token_mask=self._on_device(self.prompt_mask[: query_start[-1]]),
            snapshots=self.state_snapshots,
            captures=[
                [capture[:2] for capture in output.state_captures.get(r, ())] for r in request_ids
            ],
            verifying=verifying,
            draft_states=self.draft_states,
            draft_stride=self.draft_stride,
        )

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the model's device (itself on CPU, without a call into torch)."""
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def _positions(self, state: RowState, start: int, end: int) -> torch.Tensor:
        """Positions of tokens [start, end): the prompt's from its table, later ones count on."""
        split = min(max(start, state.prompt_len), end)
        prompt_part = state.positions[:, start:split]
        after = torch.arange(split, end) - state.prompt_len + state.next_position
        return torch.cat([prompt_part, after.expand(prompt_part.shape[0], -1)], dim=1)

    def _gather_items(self, state, start, end, q0, b, items: _StepItems) -> None:
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

    # ---- sampling ----------------------------------------------------------------------------

    def _sample(
        self, request_ids: list[str], logits: torch.Tensor, spec_token_ids: dict[str, list[int]]
    ) -> StepResult:
        """Sample each request's tokens (one, or 1..K+1 after drafts) and append them."""
        states = [self.rows[r] for r in request_ids]

        def history(index: int) -> tuple[torch.Tensor, list[int]]:
            state = states[index]
            return self.token_ids[state.row, : state.prompt_len], state.output_ids

        params = [state.params for state in states]
        drafts = [spec_token_ids.get(r, ()) for r in request_ids]
        num_outputs = [len(state.output_ids) for state in states]
        tokens, result = self.sampling.sample(
            request_ids, params, history, logits, drafts, num_outputs
        )
        for state, new_tokens in zip(states, tokens, strict=True):
            self.token_array[state.row, state.num_tokens : state.num_tokens + len(new_tokens)] = (
                new_tokens
            )
            state.num_tokens += len(new_tokens)
            state.output_ids.extend(new_tokens)
        return result


@dataclass
class _StepItems:
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
class _Batch:
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


def _recurrent_states(
    groups: Sequence[CacheGroup], num_slots: int, dtype: torch.dtype, device: torch.device | str
) -> dict[int, tuple[torch.Tensor, ...]]:
    """Layer id -> its zeroed state tensors, each [num_slots, *shape], for recurrent layers (in
    the group's own dtype, else `dtype`)."""
    return {
        layer: tuple(
            torch.zeros(num_slots, *shape, dtype=group.dtype or dtype, device=device)
            for shape in group.state_shapes
        )
        for group in recurrent_groups(groups)
        for layer in group.layer_ids
    }


def _paged_kv_caches(
    groups: Sequence[CacheGroup],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed K/V tensor per attention layer, in layer order."""
    by_layer = {
        layer: group.layer_cache_shape(num_blocks, block_size)
        for group in attention_groups(groups)
        for layer in group.layer_ids
    }
    return [torch.zeros(by_layer[layer], dtype=dtype, device=device) for layer in sorted(by_layer)]
