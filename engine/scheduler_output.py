"""What one scheduler step tells the runner, and what the runner's results change.

Ids, counts and block ids only, never tensors: the runner keeps one persistent row per request
in the runner, filled from `NewRequestData` when the request enters it and updated from
`CachedRequestData` each later step. Per step the runner first drops the rows of
`finished_ids` and `preempted_ids` (ignoring ids it has no row for), then adds `scheduled_new`.
A live request (a held prefix, or a streaming-input request) keeps its row while it waits for
input; what is appended to it reaches the runner as `AppendedInput`, the new part only, with the
request's next `CachedRequestData`, so an append costs O(new tokens) however long the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.request import PlaceholderRange, Request, RequestStatus, SamplingParams
from stillcut.engine.state_snapshots import StateCapture


@dataclass(frozen=True)
class NewRequestData:
    """A request entering the runner: new, resumed after preemption, or a held prefix that was
    extended. Tokens before `num_computed_tokens` are already in its blocks (prefix-cache hit
    or earlier prefill); output tokens are recomputed as prompt. With recurrent layers, the
    state after them is in snapshot slot `restore_slot` (None: it starts from zeros)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    mm_items: list[MultiModalItem]
    mm_positions: list[PlaceholderRange]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    hold: bool  # prefill-only: nothing is sampled for it
    restore_slot: int | None = None

    @classmethod
    def from_request(cls, request: Request, restore_slot: int | None = None) -> NewRequestData:
        """A snapshot: later changes to the request do not show through."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            mm_items=list(request.mm_items),
            mm_positions=list(request.mm_positions),
            sampling_params=request.sampling_params,
            block_ids=list(request.block_ids),
            num_computed_tokens=request.num_computed_tokens,
            hold=request.hold,
            restore_slot=restore_slot,
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class AppendedInput:
    """Input appended to a live request: `token_ids` go at index `start` of its sequence, after
    the tokens it kept (a sampled EOS that ended a segment is not kept), and `mm_positions`
    place `mm_items` in the whole sequence."""

    start: int
    token_ids: list[int]
    mm_items: list[MultiModalItem]
    mm_positions: list[PlaceholderRange]


@dataclass(frozen=True)
class CachedRequestData:
    """A request already in the runner: its new blocks (appended to its block table), how
    many of its tokens were computed before this step, and the input appended to it since it
    last ran, oldest first."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    appended: tuple[AppendedInput, ...] = ()


@dataclass
class SchedulerOutput:
    """One step: `num_scheduled_tokens[request_id]` tokens to compute for each request, and
    where to save its recurrent state among them (`state_captures`, models with recurrent
    layers only)."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_new: list[NewRequestData] = field(default_factory=list)
    scheduled_cached: list[CachedRequestData] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished, aborted or now held
    # drafts to verify: a request here is scheduled for 1 + len(drafts) tokens, its last
    # sampled one and the drafts after it
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    state_captures: dict[str, list[StateCapture]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class RequestUpdate:
    """What a step changed for one request: tokens it generated and its status after them.
    `stop_reason` is the stop token id that finished it (None for EOS, length or no stop);
    `segment_end` ("stop" or "length") says that a streaming request's segment ended here."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus
    stop_reason: int | None = None
    segment_end: str | None = None

    @property
    def finished(self) -> bool:
        return self.status.is_finished
