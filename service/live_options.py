"""What a live session may do: the client's options, the server's limits, and the errors.

The client's `start` message chooses EVS, the frame rate it sends at and how answers are
sampled; the server alone sets the limits. Each error a client can cause carries the WebSocket
close code the session ends with (None: report it and go on), so the endpoint maps them in one
place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.kernels.evs.config import STAGES
from stillcut.kernels.evs.pixels import PIXEL_THRESHOLD
from stillcut.service.errors import shown
from stillcut.service.request_limits import check_stop

CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
# a session's threshold when it gives none, per EVS stage (they measure different things)
DEFAULT_THRESHOLDS = {"embeddings": 0.1, "pixels": PIXEL_THRESHOLD}


def default_threshold(stage: str) -> float:
    """The threshold of a session that gives none, at `stage` (a stage that is none of them
    gets any: `EVSConfig` then names it)."""
    return DEFAULT_THRESHOLDS[stage] if stage in STAGES else 0.0


class LiveError(ValueError):
    """A client mistake in a live session; the message says what was wrong and what is allowed.

    `close_code` is the WebSocket code that ends the session, or None when it goes on.
    """

    close_code: int | None = None


class BadFrame(LiveError):
    """A frame that is not a PNG or JPEG, has another size than the first, or goes back in time."""

    close_code = CLOSE_UNSUPPORTED_DATA


class LiveLimitExceeded(LiveError):
    """A well-formed frame or session over a server limit (or over what the engine can hold)."""

    close_code = CLOSE_POLICY


class NoFrameYet(LiveError):
    """A question before the first frame: there is no video to ask about."""


class SessionClosed(LiveError):
    """The session was closed; nothing more can be sent to it."""


def _strings(stop: str | list | tuple) -> tuple:
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")


@dataclass(frozen=True)
class LiveLimits:
    """Bounds of one session, set by the server: frames it may send, bytes and pixels each, and
    the tubelets a narration under lag "queue" may hold waiting to be spoken about (past it a
    frame is refused: `narration.BacklogFull`)."""

    max_frames: int = 7200
    max_frame_bytes: int = 8 << 20
    max_frame_pixels: int = 3840 * 2160
    max_queued_tubelets: int = 16

    def __post_init__(self) -> None:
        for field in fields(self):
            _check_count(field.name, getattr(self, field.name))


@dataclass(frozen=True)
class LiveOptions:
    """A session's settings: threshold-mode EVS (`threshold`, `max_per_tubelet`, `floor`, and
    `stage`: "embeddings" after the tower, "pixels" before it; a threshold of None is the
    stage's default, `DEFAULT_THRESHOLDS`), the rate the client sends frames at (`fps`; one
    tubelet spans `2 / fps` seconds), sampling for answers, and the server's `limits`."""

    threshold: float | None = None
    max_per_tubelet: int | None = None
    floor: int = 0
    stage: Literal["embeddings", "pixels"] = "embeddings"
    fps: float = 2.0
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    limits: LiveLimits = LiveLimits()

    def __post_init__(self) -> None:
        fps = self.fps
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < math.inf:
            raise ValueError(f"fps={fps!r} must be a finite number > 0 (frames per second)")
        if not isinstance(self.limits, LiveLimits):
            raise ValueError(f"limits must be a LiveLimits, got {type(self.limits).__name__}")
        if not isinstance(self.stop, str | list | tuple):
            raise ValueError(f"stop={shown(self.stop)} must be a string or a list of strings")
        object.__setattr__(self, "stop", check_stop(_strings(self.stop)))
        # building them checks every EVS and sampling field, with errors naming the field
        sampling, _ = self.sampling, self.evs
        object.__setattr__(self, "stop", sampling.stop)

    @property
    def evs(self) -> EVSConfig:
        """Threshold-mode EVS: causal, so streaming and the whole clip prune alike."""
        return EVSConfig(
            mode="threshold",
            threshold=default_threshold(self.stage) if self.threshold is None else self.threshold,
            max_per_tubelet=self.max_per_tubelet,
            floor=self.floor,
            stage=self.stage,
        )

    @property
    def sampling(self) -> SamplingParams:
        """How answers are sampled."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            logprobs=self.logprobs,
        )

    @classmethod
    def from_message(
        cls, message: Mapping[str, Any], limits: LiveLimits = LiveLimits()
    ) -> LiveOptions:
        """Options from a client's `{"type": "start", ...}` message; the limits stay the
        server's. Unknown keys are errors, so a misspelt option is never silently ignored."""
        allowed = [field.name for field in fields(cls) if field.name != "limits"]
        unknown = sorted(set(message) - {"type", *allowed})
        if unknown:
            raise ValueError(f"unknown start option(s) {unknown}; allowed: {', '.join(allowed)}")
        return cls(**{name: message[name] for name in allowed if name in message}, limits=limits)
