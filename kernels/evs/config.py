"""EVS settings and the published kept-count rule.

Two modes share one frozen config: `rate` prunes a fixed fraction of the clip (vLLM's
semantics), `threshold` keeps a token whenever it moved far enough from the last kept token at
its location. Fields that belong to the other mode must stay at their defaults so that one
setting has one spelling, and `key()` can go into cache identities.

Two stages: `embeddings` (the default) compares the vision tower's output tokens; `pixels`
compares each token's merge group of normalised pixels before the tower (`pixels.py`), so the
tower then encodes only the kept groups. Both stages keep tokens by the same rules; a threshold
means a different amount in each (`pixels.PIXEL_THRESHOLD`, the pixel stage's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODES = ("rate", "threshold")
STAGES = ("embeddings", "pixels")
MAX_DISSIMILARITY = 2.0  # 1 - cos lies in [0, 2]
# The rate a request that names no EVS gets where neither the operator nor the checkpoint sets
# one (`service.evs_default`); the demo trains on it most (`demo.train.TrainConfig.evs`).
DEFAULT_RATE = 0.75


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
    most `max_per_tubelet` and at least `min(floor, h*w)` per tubelet. `stage="pixels"`
    measures dissimilarity on each token's pixels before the tower (the tower then encodes the
    kept tokens only); `"embeddings"` on the tower's output.
    """

    mode: Literal["rate", "threshold"]
    rate: float | None = None
    threshold: float | None = None
    max_per_tubelet: int | None = None
    floor: int = 0
    stage: Literal["embeddings", "pixels"] = "embeddings"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r} is not one of {STAGES}")
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

    @property
    def keeps_all(self) -> bool:
        """True when this setting keeps every token whatever their dissimilarities: rate 0, or
        threshold 0 without a cap (whether a floor covers every token depends on the grid)."""
        uncapped_zero = self.threshold == 0.0 and self.max_per_tubelet is None
        return self.is_off or (self.mode == "threshold" and uncapped_zero)

    @property
    def before_tower(self) -> bool:
        """True for the pixel stage: the tower encodes only the tokens this setting keeps."""
        return self.stage == "pixels"

    def key(self) -> str:
        """A stable string of the mode, its values and (the pixel stage only) the stage, for
        cache identities."""
        stage = ":stage=pixels" if self.before_tower else ""
        if self.mode == "rate":
            return f"evs:rate:q={float(self.rate)!r}{stage}"
        cap = "none" if self.max_per_tubelet is None else str(self.max_per_tubelet)
        return f"evs:threshold:tau={float(self.threshold)!r}:cap={cap}:floor={self.floor}{stage}"


def num_retained_tokens(num_tubelets: int, tokens_per_tubelet: int, rate: float) -> int:
    """vLLM's kept count: `max(h*w, int(t*h*w*(1 - q)))` with Python float rounding."""
    total = num_tubelets * tokens_per_tubelet
    return max(tokens_per_tubelet, int(total * (1 - rate)))
