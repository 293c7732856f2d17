"""What a narrating live session may do: the client's `start` options in narrate mode.

The same spelling as question-answer sessions for what both have (EVS: `threshold`,
`max_per_tubelet`, `floor`, `stage`, with `"threshold": null` turning EVS off; `fps`;
sampling), plus the instruction (`prompt`), how a segment ends (`max_tokens_per_segment`,
`segment_end`), the lag policy and the rollover window. Answer-only options are refused, not
ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

from stillcut.engine.request import MAX_COUNT, SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.service.live_options import LiveLimits, default_threshold

LagPolicy = Literal["queue", "latest"]
ANSWER_ONLY = ("max_tokens", "stop", "logprobs")
MAX_SEGMENT_ENDS = 16
MAX_SEGMENT_END_CHARS = 256
MAX_KEEP_S = 3600.0  # a rollover re-prefills at most this much of the stream
_EVERY_TOKEN = 2**31 - 1  # a floor no tubelet reaches: every token is kept


@dataclass(frozen=True)
class NarrateOptions:
    """A narration's settings. `max_context_tokens=None` means the engine's `max_model_len`
    (a larger value is cut to it; the instruction, one tubelet and a segment must fit);
    `keep_last_s` seconds of tubelets are re-prefilled when the sequence rolls over. EVS is
    threshold mode at `stage` ("embeddings" after the tower, "pixels" before it); `threshold`
    "default" is the stage's default (`DEFAULT_THRESHOLDS`), None turns EVS off."""

    prompt: str = ""
    fps: float = 2.0
    max_tokens_per_segment: int = 24
    segment_end: tuple[str, ...] = ("\n",)
    lag: LagPolicy = "latest"
    max_context_tokens: int | None = None
    keep_last_s: float = 30.0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    threshold: float | None | Literal["default"] = "default"
    max_per_tubelet: int | None = None
    floor: int = 0
    stage: Literal["embeddings", "pixels"] = "embeddings"
    limits: LiveLimits = LiveLimits()

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("prompt must be a non-empty string: the narration's instruction")
        fps = self.fps
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < math.inf:
            raise ValueError(f"fps={fps!r} must be a finite number > 0 (frames per second)")
        self._check_segment_end()
        if self.lag not in get_args(LagPolicy):
            raise ValueError(f"lag={self.lag!r} must be one of {get_args(LagPolicy)}")
        SamplingParams(max_tokens=self.max_tokens_per_segment, **self._sampling_fields())
        context = self.max_context_tokens
        if context is not None and (
            isinstance(context, bool)
            or not isinstance(context, int)
            or not self.max_tokens_per_segment < context <= MAX_COUNT
        ):
            raise ValueError(
                f"max_context_tokens={context!r} must be null or an integer in "
                f"(max_tokens_per_segment, {MAX_COUNT}]: the instruction, one tubelet and a "
                "segment must fit"
            )
        keep = self.keep_last_s
        if (
            isinstance(keep, bool)
            or not isinstance(keep, int | float)
            or not 0 <= keep <= MAX_KEEP_S
        ):
            raise ValueError(
                f"keep_last_s={keep!r} must be a number in [0, {MAX_KEEP_S:g}] (seconds)"
            )
        if not isinstance(self.limits, LiveLimits):
            raise ValueError(f"limits must be a LiveLimits, got {type(self.limits).__name__}")
        _ = self.evs  # building it checks the EVS fields, with errors naming the field

    def _check_segment_end(self) -> None:
        ends = self.segment_end
        if isinstance(ends, str) or not isinstance(ends, list | tuple):
            raise ValueError("segment_end must be a list of strings")
        if not 1 <= len(ends) <= MAX_SEGMENT_ENDS or not all(
            isinstance(s, str) and 1 <= len(s) <= MAX_SEGMENT_END_CHARS for s in ends
        ):
            raise ValueError(
                f"segment_end must hold 1 to {MAX_SEGMENT_ENDS} non-empty strings of at most "
                f"{MAX_SEGMENT_END_CHARS} characters"
            )
        object.__setattr__(self, "segment_end", tuple(ends))

    def _sampling_fields(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }

    @property
    def evs(self) -> EVSConfig:
        """Threshold-mode EVS (causal: its reference carries from tubelet to tubelet). With
        `threshold` null EVS is off: the same pruner with a floor of every token keeps all."""
        if self.threshold is None:
            if self.max_per_tubelet is not None or self.floor:
                raise ValueError("max_per_tubelet and floor need a threshold (EVS is off)")
            off = EVSConfig(mode="threshold", threshold=0.0, floor=_EVERY_TOKEN, stage=self.stage)
            if off.before_tower:  # EVS off has no stage: one setting, one spelling
                raise ValueError(f"stage={self.stage!r} needs a threshold (EVS is off)")
            return off
        threshold = self.threshold
        if isinstance(threshold, str) and threshold == "default":
            threshold = default_threshold(self.stage)
        return EVSConfig(
            mode="threshold",
            threshold=threshold,
            max_per_tubelet=self.max_per_tubelet,
            floor=self.floor,
            stage=self.stage,
        )

    def sampling(self, segment_end_ids: frozenset[int]) -> SamplingParams:
        """How segments are sampled: each ends at a segment-end token or its token cap."""
        return SamplingParams(
            max_tokens=self.max_tokens_per_segment,
            stop_token_ids=tuple(sorted(segment_end_ids)),
            **self._sampling_fields(),
        )

    @classmethod
    def from_message(
        cls, message: Mapping[str, Any], limits: LiveLimits = LiveLimits()
    ) -> NarrateOptions:
        """Options from `{"type": "start", "mode": "narrate", ...}`; unknown keys and the
        answer-only options are errors."""
        refused = sorted(set(ANSWER_ONLY) & set(message))
        if refused:
            raise ValueError(f"{refused} are answer-only options, refused in narrate mode")
        allowed = [field.name for field in fields(cls) if field.name != "limits"]
        unknown = sorted(set(message) - {"type", "mode", *allowed})
        if unknown:
            raise ValueError(f"unknown start option(s) {unknown}; allowed: {', '.join(allowed)}")
        return cls(**{name: message[name] for name in allowed if name in message}, limits=limits)
