"""A request and its sampling parameters: what the scheduler tracks from admission to finish.

A request is its prompt (token ids plus the multimodal items whose placeholders sit in it), how
to sample, and a little mutable state the scheduler advances: status, output tokens, how many
tokens already have KV (`num_computed_tokens`) and the KV blocks that hold them. Output tokens
count as prompt when a preempted request is recomputed, so `all_token_ids` is what gets
prefilled. A `hold` request is prefill-only: its KV is kept afterwards (status HELD) so that a
live session can extend it and fork questions from it. A `streaming` request generates in
segments: a stop (EOS, a stop token, `max_tokens`) ends the segment, not the request, which then
waits for input (status HELD, EOS not kept). Input appended to a live request (either kind)
turns its output so far into prompt, so `max_tokens` counts per segment.
"""

from __future__ import annotations

import bisect
import enum
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from stillcut.engine.multimodal import MultiModalItem

MAX_LOGPROBS = 20
MAX_COUNT = 2**31 - 1  # token counts and ids: any larger one is refused, never overflows a tensor
_MAX_SEED = 2**64 - 1
# Temperature and repetition penalty divide logits (a temperature at or below the sampler's
# greedy threshold makes its row greedy, so no division by it ever overflows).
_MIN_SCALE, _MAX_SCALE = 0.01, 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens and when to stop. `top_k=0` and `top_p=1` turn those filters
    off; `temperature=0` is greedy. Stop strings are matched by the detokenizer, not here."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # JSON hands lists (or one bare string); store tuples so the params stay hashable
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_range(
            "max_tokens", self.max_tokens, 1, MAX_COUNT, f"in [1, {MAX_COUNT}]", integer=True
        )
        _check_range("temperature", self.temperature, 0.0, _MAX_SCALE, f"in [0, {_MAX_SCALE:g}]")
        _check_range("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", low_open=True)
        _check_range(
            "top_k", self.top_k, 0, MAX_COUNT, f"in [0, {MAX_COUNT}] (0 = off)", integer=True
        )
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_range("seed", self.seed, 0, _MAX_SEED, "in [0, 2**64 - 1]", integer=True)
        _check_range(
            "repetition_penalty",
            self.repetition_penalty,
            _MIN_SCALE,
            _MAX_SCALE,
            f"in [{_MIN_SCALE:g}, {_MAX_SCALE:g}]",
        )
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must hold non-empty strings only")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_COUNT
            for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids={self.stop_token_ids!r} must hold ints in [0, {MAX_COUNT}]"
            )
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)


def _check_range(
    name: str,
    value: float,
    low: float,
    high: float,
    allowed: str = "",
    *,
    low_open: bool = False,
    integer: bool = False,
) -> None:
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name}={value!r} must be {'an int' if integer else 'a number'}")
    # NaN fails every comparison, so it lands here too; infinities are never meaningful
    if not ((low < value if low_open else low <= value) and value <= high) or math.isinf(value):
        raise ValueError(f"{name}={value!r} must be {allowed or f'in [{low}, {high}]'}")


class RequestStatus(enum.Enum):
    """Where a request is in its life. HELD: a live request keeping its KV, waiting for input."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    HELD = "held"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        """True for the three FINISHED_* statuses; their value is the OpenAI finish reason."""
        return self.name.startswith("FINISHED_")


class PlaceholderRange(NamedTuple):
    """Where an item's placeholder tokens sit in the prompt: `[offset, offset + length)`."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def placeholder_ranges(
    token_ids: Sequence[int],
    items: Sequence[MultiModalItem],
    placeholder_token_ids: Collection[int],
) -> list[PlaceholderRange]:
    """The placements of `items`, in order: each starts at the next placeholder token and spans
    `item.num_tokens` of them. Consecutive items may share one run (live-stream tubelets)."""
    is_placeholder = [t in placeholder_token_ids for t in token_ids]
    ranges, cursor = [], 0
    for index, item in enumerate(items):
        try:
            offset = is_placeholder.index(True, cursor)
        except ValueError:
            raise ValueError(f"item {index} has no placeholder tokens left in the prompt") from None
        end = offset + item.num_tokens
        if end > len(token_ids) or not all(is_placeholder[offset:end]):
            raise ValueError(
                f"item {index} needs {item.num_tokens} consecutive placeholder tokens from "
                f"index {offset}; the prompt has fewer"
            )
        ranges.append(PlaceholderRange(offset, item.num_tokens))
        cursor = end
    if any(is_placeholder[cursor:]):
        raise ValueError(f"the prompt has placeholder tokens after index {cursor} but no item")
    return ranges


@dataclass(eq=False)
class Request:
    """One generation (or, with `hold`, one held prefix) and its scheduling state.

    `mm_positions[i]` places `mm_items[i]` in the prompt (see `placeholder_ranges`). Every item
    needs an `identifier`: prefix-cache hashes use it to tell media with equal placeholders
    apart. `block_ids` belong to the KV cache manager, which keeps them in step here.
    """

    request_id: str
    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem] = field(default_factory=list)
    mm_positions: list[PlaceholderRange] = field(default_factory=list)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    eos_token_ids: tuple[int, ...] = ()  # the checkpoint's; each stops unless ignore_eos
    arrival_time: float = field(default_factory=time.monotonic)
    hold: bool = False
    streaming: bool = False
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at first schedule
    block_ids: list[int] = field(default_factory=list, init=False)
    # speculative decoding: the tokens proposed for the next step, and what verifying cost
    spec_token_ids: list[int] = field(default_factory=list, init=False)
    num_draft_tokens: int = field(default=0, init=False)
    num_accepted_tokens: int = field(default=0, init=False)
    _num_visual_tokens: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        # plain ints: prefix-cache hashes serialize them, and numpy ints serialize differently
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.mm_items = list(self.mm_items)
        self.mm_positions = [PlaceholderRange(*p) for p in self.mm_positions]
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must not be empty")
        if min(self.prompt_token_ids) < 0:
            raise ValueError(f"request {self.request_id!r}: token ids must be >= 0")
        _check_placements(self.mm_items, self.mm_positions, 0, len(self.prompt_token_ids))
        self._num_visual_tokens = sum(item.num_tokens for item in self.mm_items)
        if self.hold and self.streaming:
            raise ValueError(f"request {self.request_id!r}: hold and streaming exclude each other")

    @property
    def is_live(self) -> bool:
        """Whether the request takes appended input: a held prefix or a streaming request."""
        return self.hold or self.streaming

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output: what the KV cache holds once everything is computed."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]`, without copying the rest."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        output = self.output_token_ids[max(start - num_prompt, 0) : end - num_prompt]
        return self.prompt_token_ids[start:] + output if start < num_prompt else output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_visual_tokens(self) -> int:
        return self._num_visual_tokens

    def append_input(
        self,
        token_ids: Sequence[int],
        items: Sequence[MultiModalItem] = (),
        positions: Sequence[PlaceholderRange] = (),
    ) -> int:
        """Append input after the tokens so far (item offsets relative to `token_ids`); the
        output so far becomes prompt. Returns the index of the first appended token. Checks
        everything before changing anything; costs O(appended + output) tokens."""
        if not token_ids:
            raise ValueError(f"request {self.request_id!r}: the appended input has no tokens")
        start = self.num_tokens
        shifted = [PlaceholderRange(p[0] + start, p[1]) for p in positions]
        _check_placements(list(items), shifted, start, start + len(token_ids))
        self.prompt_token_ids.extend(self.output_token_ids)
        self.output_token_ids = []  # a new list: snapshots of the old one stay valid
        self.prompt_token_ids.extend(int(t) for t in token_ids)
        self.mm_items.extend(items)
        self.mm_positions.extend(shifted)
        self._num_visual_tokens += sum(item.num_tokens for item in items)
        return start

    def append_output(
        self, token_ids: Sequence[int]
    ) -> tuple[list[int], RequestStatus | None, int | None]:
        """Append sampled tokens up to the first that stops the request. Returns them, the
        finished status if one stopped it, and the stop token id (None for EOS, as OpenAI)."""
        for index, token_id in enumerate(token_ids):
            self.output_token_ids.append(token_id)
            status, stop_reason = self.stop_after(token_id)
            if status is not None:
                return list(token_ids[: index + 1]), status, stop_reason
        return list(token_ids), None, None

    def stop_after(self, token_id: int) -> tuple[RequestStatus | None, int | None]:
        """Whether the output token just appended ends the request, and its stop token id."""
        params = self.sampling_params
        if token_id in self.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def chunk_end_at_or_before(self, position: int) -> int:
        """The largest chunk end <= `position` that does not split a bidirectional item.

        Tokens of such an item attend to each other both ways, so they must be computed in one
        forward pass: an end inside one moves back to the item's start.
        """
        # placements are sorted and disjoint: only the first ending after `position` can hold it
        index = bisect.bisect_right(self.mm_positions, position, key=lambda p: p.end)
        if index < len(self.mm_positions):
            item, place = self.mm_items[index], self.mm_positions[index]
            if item.bidirectional and place.offset < position:
                return place.offset
        return position


def _check_placements(
    items: list[MultiModalItem], positions: list[PlaceholderRange], begin: int, end: int
) -> None:
    """Placements must match their items, sit in `[begin, end)` in order, and not overlap."""
    if len(items) != len(positions):
        raise ValueError(f"{len(items)} mm_items but {len(positions)} mm_positions")
    cursor = begin
    for index, (item, place) in enumerate(zip(items, positions, strict=True)):
        if not item.identifier:
            raise ValueError(f"mm item {index} has no identifier; the prefix cache needs one")
        if place.length != item.num_tokens:
            raise ValueError(
                f"mm_positions[{index}].length={place.length} must equal the item's "
                f"num_tokens={item.num_tokens}"
            )
        if place.offset < cursor or place.end > end:
            raise ValueError(
                f"mm_positions[{index}]={tuple(place)} must lie in [{cursor}, {end}] "
                "(inside the prompt, after the previous item)"
            )
        cursor = place.end
