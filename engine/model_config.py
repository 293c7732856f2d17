"""What stillcut needs from a checkpoint's config.json, whatever its family.

`model_type` picks the family's registry entry (`models.families`); its config reader turns the
vision section into the family's own frozen vision config and reads the media token ids. The
text section stays a read-only dict for the family's language model to interpret: transformers
5.x nests it in `text_config`, older saves keep its fields at the top level.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stillcut.engine.cache_groups import CacheGroup
    from stillcut.engine.models.registry import ModelFamily


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unsupported config, missing or mismatched weights."""


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's config: its family's entry, its vision config, the media token ids, and
    read-only views of the text section and of the whole file (`raw`).

    `video_token_id` is None for a family whose videos are frames of images, the vision
    start/end ids for one whose prompt format writes its delimiters as text.
    `native_evs_rate` is the checkpoint's own pruning rate (0.0: it asks for EVS off), None
    when its family has no such setting.
    """

    model_type: str
    family: ModelFamily
    vision: Any
    text: Mapping[str, Any]
    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    tie_word_embeddings: bool
    raw: Mapping[str, Any]
    native_evs_rate: float | None = None

    def __post_init__(self) -> None:
        if (self.video_token_id is None) == self.family.has_video_token:
            raise ValueError(
                f"video_token_id={self.video_token_id}: family {self.model_type!r} "
                f"{'has' if self.family.has_video_token else 'has no'} video token"
            )
        rate = self.native_evs_rate
        if rate is not None and not 0.0 <= rate < 1.0:
            raise ValueError(f"the checkpoint's EVS pruning rate {rate} must be in [0, 1)")

    @property
    def cache_groups(self) -> tuple[CacheGroup, ...]:
        """Which layers keep paged K/V and which keep recurrent state (see `cache_groups`)."""
        return self.family.cache_groups(self)

    @property
    def live_sessions_refusal(self) -> str | None:
        """Why this checkpoint serves no live sessions, or None when it serves them (its
        family's registry entry says so)."""
        if self.family.live_sessions:
            return None
        return f"live sessions are not supported for {self.model_type!r} checkpoints"


def load_model_config(path: str | PathLike[str]) -> ModelConfig:
    """Read `<path>/config.json` (or a config.json path) into a ModelConfig."""
    from stillcut.engine.models.families import FAMILIES

    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read model config {file}: {error}") from error
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(
            f"{file}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(FAMILIES.model_types)}"
        )
    text = raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"}
    try:
        read = family.read_config(raw)
        rate = None if family.native_evs_rate is None else family.native_evs_rate(raw)
        return ModelConfig(
            model_type=model_type,
            family=family,
            vision=read.vision,
            text=MappingProxyType(text),
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")
            ),
            raw=MappingProxyType(raw),
            native_evs_rate=rate,
            **read.token_ids.__dict__,
        )
    except KeyError as error:
        raise CheckpointError(f"{file}: required field {error} is missing") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{file}: {error}") from error
