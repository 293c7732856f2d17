"""Which EVS setting applies when a request names none, and why.

The order of precedence: a request's own `evs`; else what the operator configured (the
server's or the command line's `--evs-rate`, `--evs-threshold`, `--no-evs`, or `VideoLLM(evs=)`);
else the checkpoint's own pruning rate where its family defines one (a rate of 0 means EVS
off); else rate 0.75. Rate mode bounds a clip's token count (and so its KV and admission cost)
whatever its content, and 0.75 is the pruning the EVS paper reports as nearly free in
accuracy; a threshold is in units of the model's embedding dissimilarity, so it needs tuning
per model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stillcut.engine.model_config import ModelConfig
from stillcut.kernels.evs import EVSConfig
from stillcut.kernels.evs.config import DEFAULT_RATE

DEFAULT_EVS = EVSConfig(mode="rate", rate=DEFAULT_RATE)
UNSET = "default"  # an operator who configured nothing: the checkpoint's rate or DEFAULT_EVS
EVSChoice = EVSConfig | None | Literal["default"]  # None: EVS off


@dataclass(frozen=True)
class EVSDefault:
    """The setting a request without `evs` gets (None: EVS off) and where it comes from."""

    evs: EVSConfig | None
    source: Literal["configured", "checkpoint", "built-in"]

    @property
    def setting(self) -> str:
        return "off" if self.evs is None or self.evs.is_off else self.evs.key()

    def to_dict(self) -> dict[str, str]:
        """What `/health` and `/v1/models` report."""
        return {"setting": self.setting, "source": self.source}


def resolve_evs_default(model_config: ModelConfig, configured: EVSChoice = UNSET) -> EVSDefault:
    """The EVS default for a checkpoint, given what the operator `configured` (`UNSET`: none)."""
    if not (isinstance(configured, str) and configured == UNSET):
        return EVSDefault(configured, "configured")
    rate = model_config.native_evs_rate
    if rate is not None:
        return EVSDefault(None if rate == 0 else EVSConfig(mode="rate", rate=rate), "checkpoint")
    return EVSDefault(DEFAULT_EVS, "built-in")
