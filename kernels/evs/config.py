"""EVS settings and the published kept-count rule.

Two modes share one frozen config: `rate` prunes a fixed fraction of the clip (vLLM's
semantics), `threshold` keeps a token whenever it moved far enough from the last kept token at
its location. Fields that belong to the other mode must stay at their defaults so that one
setting has one spelling, and `key()` can go into cache identities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODES = ("rate", "threshold")
MAX_DISSIMILARITY = 2.0  # 1 - cos lies in [0, 2]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EVSConfig:
    """How EVS prunes a clip.

    `EVSConfig(mode="rate", rate=q)` keeps `max(h*w, int(t*h*w*(1 - q)))` tokens, q in [0, 1).
    `EVSConfig(mode="threshold", threshold=tau, max_per_tubelet=None, floor=0)` keeps a token
    whose dissimilarity to the last kept token at its location is >= tau (tau in [0, 2]), at
    most `max_per_tubelet` and at least `min(floor, h*w)` per tubelet.
    """

    mode: Literal["rate", "threshold"]
    rate: float | None = None
    threshold: float | None = None
    max_per_tubelet: int | None = None
    floor: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if self.mode == "rate":
            self._validate_rate()
        else:
            self._validate_threshold()

    def _validate_rate(self) -> None:
        if not _is_number(self.rate) or not 0.0 <= self.rate < 1.0:
            raise ValueError(f"rate={self.rate!r} must be a number in [0, 1) for mode='rate'")
        unused = {"threshold": None, "max_per_tubelet": None, "floor": 0}
        for name, default in unused.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is only used by mode='threshold'; "
                    f"leave it at {default!r} for mode='rate'"
                )

    def _validate_threshold(self) -> None:
        if not _is_number(self.threshold) or not 0.0 <= self.threshold <= MAX_DISSIMILARITY:
            raise ValueError(
                f"threshold={self.threshold!r} must be a number in [0, 2] for mode='threshold'"
            )
        if self.rate is not None:
            raise ValueError(
                f"rate={self.rate!r} is only used by mode='rate'; leave it at None "
                "for mode='threshold'"
            )
        cap = self.max_per_tubelet
        if cap is not None and (not _is_count(cap) or cap < 1):
            raise ValueError(f"max_per_tubelet={cap!r} must be an integer >= 1 or None")
        if not _is_count(self.floor) or self.floor < 0:
            raise ValueError(f"floor={self.floor!r} must be an integer >= 0")
        if cap is not None and self.floor > cap:
            raise ValueError(f"floor={self.floor} must be <= max_per_tubelet={cap}")

    @classmethod
    def off(cls) -> EVSConfig:
        """The setting that keeps every token (rate 0); callers may skip `prune` for it."""
        return cls(mode="rate", rate=0.0)

    @property
    def is_off(self) -> bool:
        """True when this setting can never drop a token."""
        return self.mode == "rate" and self.rate == 0.0

    def key(self) -> str:
        """A stable string of the mode and its values, for cache identities."""
        if self.mode == "rate":
            return f"evs:rate:q={float(self.rate)!r}"
        cap = "none" if self.max_per_tubelet is None else str(self.max_per_tubelet)
        return f"evs:threshold:tau={float(self.threshold)!r}:cap={cap}:floor={self.floor}"


def num_retained_tokens(num_tubelets: int, tokens_per_tubelet: int, rate: float) -> int:
    """vLLM's kept count: `max(h*w, int(t*h*w*(1 - q)))` with Python float rounding."""
    total = num_tubelets * tokens_per_tubelet
    return max(tokens_per_tubelet, int(total * (1 - rate)))
