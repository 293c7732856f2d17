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
and the request's next step restores those after its last accepted one
(`RecurrentRows.roll_back`). Input preparation lives in `step_inputs`, the recurrent states and
their snapshot and verify bookkeeping in `recurrent_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stillcut.engine.cache_groups import CacheGroup, attention_groups
from stillcut.engine.cuda_graphs import DecodeGraphs
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.recurrent_rows import RecurrentRows
from stillcut.engine.request import PlaceholderRange, SamplingParams
from stillcut.engine.row_sampler import RowSampler, StepResult
from stillcut.engine.scheduler_output import AppendedInput, NewRequestData, SchedulerOutput
from stillcut.engine.step_buffers import StepBuffers
from stillcut.engine.step_inputs import prepare_inputs


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
        self.recurrent = RecurrentRows(
            cache_groups,
            max_num_reqs=max_num_reqs,
            num_snapshots=num_state_snapshots,
            max_spec_tokens=max_spec_tokens,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=state_dtype or kv_dtype,
            device=self.device,
        )
        self.recurrent_states = self.recurrent.states
        self.state_snapshots = self.recurrent.snapshots
        self.draft_states = self.recurrent.draft_states
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
        # `prepare_inputs` writes token inputs straight into the staging views.
        self.input_ids = self.buffers.host.input_ids
        self.positions = self.buffers.host.positions
        self.slot_mapping = self.buffers.host.slot_mapping
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
        batch = prepare_inputs(self, output)
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
            row = self.rows[cached.request_id].row
            self.recurrent.roll_back(cached.request_id, row, cached.num_computed_tokens)
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
            self.recurrent.restore(row, new.restore_slot)

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

    def _drop_row(self, request_id: str) -> None:
        self.recurrent.verified.pop(request_id, None)
        state = self.rows.pop(request_id, None)
        if state is not None:
            # the attention backends read a row's padding as block 0, never as someone else's
            self.block_table[state.row, : len(state.block_ids)] = 0
            self.free_rows.append(state.row)

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
