"""What the engine hands back per step: a request's output so far and its metrics.

An output is built for every request at every step, so building one must not cost more as a
generation grows: its cumulative token ids, logprobs and text are `Snapshot`s of the
request's append-only lists, taken in O(1), and the text is joined only if someone reads it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

T = TypeVar("T")


class Snapshot(Sequence[T]):
    """The items an append-only list holds now; later appends to it do not show.

    Equal to any list, tuple or snapshot with the same items. Appending to the list from
    another thread while this is read is safe: only the first `len(self)` items are read.
    """

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[T]) -> None:
        self._items = items
        self._length = len(items)

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step > 0:
                return self._items[start:stop:step]
            return [self._items[i] for i in range(start, stop, step)]  # stop may be -1 here
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError(f"index {index} out of range for {self._length} items")
        return self._items[position]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot | list | tuple):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class RequestMetrics:
    """Times (monotonic seconds) and token counts of one request."""

    arrival_time: float
    num_prompt_tokens: int
    video_tokens_kept: int
    video_tokens_total: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    # speculative decoding: drafts verified, and those accepted (OpenAI's prediction tokens)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # per append to a live request: tokens computed before its next output (its input, plus
    # a sampled token not yet computed)
    append_prefill_tokens: list[int] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def ttft(self) -> float | None:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _span(self.first_token_time, self.finished_time)


@dataclass
class RequestOutput:
    """What one step produced for one request: cumulative token ids, logprobs and text (as
    of this step), plus this step's new tokens and text `delta`."""

    request_id: str
    token_ids: Sequence[int]
    new_token_ids: list[int]
    text_pieces: Sequence[str]  # the deltas so far; `text` joins them
    delta: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", or "held" for a finished prefill
    # as OpenAI and vLLM: the stop string or stop token id that ended it; None for EOS
    stop_reason: str | int | None
    metrics: RequestMetrics
    # per token: (top ids, their logprobs, the sampled token's logprob)
    logprobs: Sequence[tuple[list[int], list[float], float]] = field(default_factory=list)
    # a streaming request's segment ended here ("stop" or "length"); it waits for input
    segment_end: str | None = None

    @functools.cached_property
    def text(self) -> str:
        """The output text so far: every delta up to this one."""
        return "".join(self.text_pieces)


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
