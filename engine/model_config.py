"""What stillcut needs from a checkpoint's config.json, whatever its family.

`model_type` picks the family's registry entry (`checkpoint.load_model_config` reads the file);
its config reader turns the vision section into the family's own frozen vision config and reads
the media token ids (`FamilyConfig`). The text section stays a read-only dict for the family's
language model to interpret: transformers 5.x nests it in `text_config`, older saves keep its
fields at the top level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stillcut.engine.cache_groups import CacheGroup
    from stillcut.engine.models.registry import ModelFamily


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unsupported config, missing or mismatched weights."""


@dataclass(frozen=True)
class MediaTokenIds:
    """The ids a family's prompts place media with. `video_token_id` is None for a family
    without a video placeholder (its videos are written as image items, one per frame); the
    vision start/end ids are None for a family whose prompt format writes its own delimiters
    as text."""

    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if (value is None and name == "image_token_id") or (value is not None and value < 0):
                raise ValueError(f"{name}={value} must be >= 0")
        if self.image_token_id == self.video_token_id:
            raise ValueError(f"image_token_id={self.image_token_id} must differ from video's")


@dataclass(frozen=True)
class FamilyConfig:
    """What a family's config reader takes from config.json besides the text section."""

    vision: Any  # the family's own frozen vision config
    token_ids: MediaTokenIds


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
