"""Which decoded frame each sample time gets.

Sample times are `start + k / fps` inside [start, end); a range longer than `max_frames / fps`
gets `max_frames` evenly spread times instead, and `num_frames` asks for that many evenly.
Each time takes the last frame whose timestamp is at or before it; a time before the first
frame takes the first frame. `FrameSelector` applies that rule to frames arriving one by one
in presentation order, holding only the latest candidate, so a whole clip is never in memory
and unsampled frames are never converted.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# Timestamps are rationals turned into floats; this absorbs the rounding, far below any frame gap.
TIME_EPS_S = 1e-6


@dataclass(frozen=True)
class SamplePlan:
    """Sample times (seconds from the stream start) and the rate they were drawn at."""

    times: tuple[float, ...]
    sample_fps: float


def plan_samples(
    start: float, duration: float, fps: float, max_frames: int, num_frames: int | None = None
) -> SamplePlan:
    """Sample times for the range [start, start + duration); always at least one. With
    `num_frames`, exactly that many, evenly spread (as with a range past `max_frames / fps`)."""
    assert fps > 0 and max_frames >= 1 and duration >= 0, (fps, max_frames, duration)
    evenly = num_frames if num_frames is not None else max_frames
    if num_frames is not None or duration * fps > max_frames:
        step = duration / evenly
        rate = evenly / duration if duration > 0 else fps
        return SamplePlan(tuple(start + k * step for k in range(evenly)), rate)
    num_samples = max(1, math.ceil(duration * fps - TIME_EPS_S))
    return SamplePlan(tuple(start + k / fps for k in range(num_samples)), fps)


@dataclass(frozen=True)
class Pick(Generic[T]):
    """`item` (decoded at `time`) fills the next `num_samples` sample slots."""

    item: T
    time: float
    num_samples: int


class FrameSelector(Generic[T]):
    """Streams frames in presentation order and settles each sample time as soon as it can.

    A frame is only a candidate until the next frame's time passes a sample time; then the
    candidate is picked for every sample time it covers. Picks come out in sample order, and an
    item is picked at most once (with a count), so callers convert each picked frame once.
    """

    def __init__(self, times: Sequence[float]) -> None:
        self._times = tuple(times)
        self._num_assigned = 0  # sample times already settled or owed to the candidate
        self._candidate: tuple[float, T] | None = None
        self._num_owed = 0  # times before the first frame: the first frame fills them

    @property
    def done(self) -> bool:
        """True once every sample time is assigned; later frames cannot change the result."""
        return self._num_assigned == len(self._times)

    def push(self, time: float, item: T) -> Pick[T] | None:
        """Offer the next frame; returns the pick this frame settles, if any."""
        first = self._num_assigned
        while self._num_assigned < len(self._times) and (
            self._times[self._num_assigned] < time - TIME_EPS_S
        ):
            self._num_assigned += 1
        num_passed = self._num_assigned - first
        pick = None
        if self._candidate is None:
            self._num_owed = num_passed
        elif num_passed + self._num_owed > 0:
            pick = Pick(self._candidate[1], self._candidate[0], num_passed + self._num_owed)
            self._num_owed = 0
        self._candidate = (time, item)
        return pick

    def finish(self) -> Pick[T] | None:
        """The last pick: the final candidate fills every sample time still open."""
        num_left = len(self._times) - self._num_assigned + self._num_owed
        self._num_assigned = len(self._times)
        self._num_owed = 0
        if self._candidate is None or num_left == 0:
            return None
        return Pick(self._candidate[1], self._candidate[0], num_left)


def predict_picks(frames: Iterable[tuple[float, T]], times: Sequence[float]) -> list[Pick[T]]:
    """The picks `FrameSelector` makes for `frames` ((time, item) in presentation order).

    Run on packet timestamps before decoding, this names the frames worth decoding.
    """
    selector: FrameSelector[T] = FrameSelector(times)
    picks = []
    for time, item in frames:
        picks.append(selector.push(time, item))
        if selector.done:
            break
    picks.append(selector.finish())
    return [pick for pick in picks if pick is not None]
