"""The runner's recurrent states and what it keeps of them across steps.

A model with recurrent layers (Mamba2, Gated DeltaNet) keeps, per recurrent layer, one state per
request row, beside the slots of recurrent-state snapshots (where a prefix-cache hit of a hybrid
model restarts: a request entering from a snapshot has its row's states copied from its slot,
and the recurrent layers save their states into the slots a step's captures name; which slot
holds what is `state_snapshots`' business) and, with speculation, the states after each scored
position of a verify step, from which a request's next step restores those after its last
accepted token (`roll_back`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from stillcut.engine.cache_groups import CacheGroup, recurrent_groups
from stillcut.engine.scheduler_output import SchedulerOutput
from stillcut.kernels.mamba2 import RecurrentMetadata

if TYPE_CHECKING:
    from stillcut.engine.runner import RowState


class RecurrentRows:
    """Layer id -> state tensors, for rows (`states`, each `[max_num_reqs, *shape]`: row r is
    request row r's), snapshot slots (`snapshots`, `[num_snapshots, *shape]`) and verify steps
    (`draft_states`, `[max_num_reqs * (1 + max_spec_tokens), *shape]`: slot
    `row * (1 + K) + j` is the row's state after its j-th scored token). Empty without
    recurrent layers."""

    def __init__(
        self,
        cache_groups: Sequence[CacheGroup],
        *,
        max_num_reqs: int,
        num_snapshots: int,
        max_spec_tokens: int,
        max_num_batched_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.device = device
        self.states = _recurrent_states(cache_groups, max_num_reqs, dtype, device)
        self.snapshots = _recurrent_states(cache_groups, num_snapshots, dtype, device)
        self.draft_stride = 1 + max_spec_tokens
        self.draft_states = _recurrent_states(
            cache_groups, max_num_reqs * self.draft_stride if max_spec_tokens else 0,
            dtype, device,
        )  # fmt: skip
        self.verified: dict[str, int] = {}  # request id -> where its last verify step started
        # which scheduled tokens are prompt tokens (for recurrent layers), staged on the host
        self.prompt_mask = torch.zeros(max_num_batched_tokens, dtype=torch.bool)
        self.prompt_array = self.prompt_mask.numpy()

    def restore(self, row: int, slot: int) -> None:
        """Copy snapshot `slot` into `row`'s states (a request entering from a prefix hit)."""
        for layer, states in self.states.items():
            for tensor, snapshot in zip(states, self.snapshots[layer], strict=True):
                tensor[row] = snapshot[slot]

    def roll_back(self, request_id: str, row: int, num_computed: int) -> None:
        """A request whose last step verified drafts runs again with `num_computed` tokens
        computed (the scheduler rolled back those past the first rejected draft, or past a
        stop): its row's recurrent states become those after its last computed token, kept
        by the verify step (`RecurrentMetadata.verify_positions`). Per-position states cost
        (1 + K) states per row in memory, and writing them about as much as the update itself
        (each position's update rewrites the whole state anyway); recomputing the accepted
        tokens instead would cost another forward of the model."""
        start = self.verified.pop(request_id, None)
        if start is None or num_computed == start + self.draft_stride:
            return  # every scored token accepted: the row holds their states already
        slot = row * self.draft_stride + num_computed - start - 1
        for layer, states in self.states.items():
            for tensor, drafts in zip(states, self.draft_states[layer], strict=True):
                tensor[row] = drafts[slot]

    def metadata(
        self,
        output: SchedulerOutput,
        request_ids: list[str],
        computed: dict[str, int],
        rows: Mapping[str, RowState],
    ) -> RecurrentMetadata | None:
        """Each request's state row, whether its state starts fresh (its first computed
        token is token 0: a new request, or one recomputed after preemption), which
        scheduled tokens are prompt tokens, where to save snapshots, and which requests verify
        drafts (their start is kept for `roll_back`). None for a model without recurrent
        layers."""
        if not self.states:
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
            num_prompt = max(rows[request_id].prompt_len - computed[request_id], 0)
            end = min(query_start[b] + num_prompt, query_start[b + 1])
            prompt_token_mask[query_start[b] : end] = True
        verifying = [bool(output.spec_token_ids.get(r)) for r in request_ids]
        for request_id, verifies in zip(request_ids, verifying, strict=True):
            if verifies:
                self.verified[request_id] = computed[request_id]
        return RecurrentMetadata(
            states=self.states,
            state_rows_cpu=[rows[r].row for r in request_ids],
            fresh=[computed[r] == 0 for r in request_ids],
            query_start_loc_cpu=query_start,
            prompt_token_mask=self._on_device(self.prompt_mask[: query_start[-1]]),
            snapshots=self.snapshots,
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
