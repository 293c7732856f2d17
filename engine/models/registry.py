"""The family registry: one entry per config.json `model_type` says everything family-specific.

An entry names the family's config reader, language model, vision tower, media preprocessing
and prompt format, and carries the flags the shared code branches on: how positions work,
whether image items attend bidirectionally, whether a video has its own placeholder token,
where a checkpoint keeps its own EVS pruning rate, whether live sessions are served, how a
narration writes each tubelet (or that the family does not narrate), and which
layers keep which cache (`cache_groups`). The runner, scheduler, KV cache, engine, prompt
processor, vision pipeline, service and kernels read these fields and never a family's name, so
adding a family is its own folder plus one `register` call (the built-in ones are in
`families`, each imported on first use of its `model_type`). Classes are named as
"module:attribute" and imported on first use: the engine never imports a vision tower, and
nothing imports PyAV. An entry also names the family's test-checkpoint recipe
(`checkpoints`), which the checkpoint factory (`engine.factory`, above the registry) builds
with: `build_checkpoint(folder, preset, family=model_type)`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, get_args

from stillcut.engine.cache_groups import CacheGroup
from stillcut.engine.prompt_formats import PromptFormat

if TYPE_CHECKING:
    from stillcut.engine.model_config import FamilyConfig, ModelConfig

PositionsKind = Literal["mrope", "1d", "none"]
POSITION_ROWS: Mapping[str, int] = MappingProxyType({"mrope": 3, "1d": 1, "none": 1})


@dataclass(frozen=True)
class ModelFamily:
    """One registry entry; see the module docstring.

    `read_config(raw config.json)` returns a `FamilyConfig` (raise KeyError / ValueError for
    what is missing or unsupported); `cache_groups(model_config)` the layers' cache groups;
    `native_evs_rate(raw)` the checkpoint's own pruning rate (0.0: the checkpoint asks for EVS
    off) — None as the field means the family has no such rate. `language_model`,
    `vision_tower` and `media` are "module:attribute" names: the language model class (with
    `from_checkpoint(path, dtype, device)`), the tower class (built from the vision config) and
    the media class (built from `(checkpoint folder, model_config)`, it preprocesses frames and
    encodes batches). `weight_prefixes` maps stored tensor-name prefixes to the canonical
    `visual.` / `language_model.` / `lm_head.` ones. `narration_timestamp` is the text a
    narration writes before each tubelet (`{t}`: its time in seconds, as the prompt format's
    `tubelet_time` gives it), which then follows as its own one-tubelet video between the
    vision markers; None: the family does not narrate. `checkpoints` ("module:attribute",
    None: the family builds none) names the family's `factory.recipe.CheckpointRecipe`, which
    writes its tiny test checkpoints.
    `pixel_budget` names the per-request video pixel options the family's
    processor takes (such as `min_pixels`, `max_pixels`); its media class then has
    `pixel_budget()` (the values in force) and `with_pixel_budget(**values)` (a media with a
    request's values, ValueError naming one out of range). Empty: none.
    `pixel_stage_refusal` says why EVS before the tower (`EVSConfig(stage="pixels")`) does not
    apply to the family; None when its media class's `encode` takes per-input `kept` masks of
    tokens and its tower encodes only those.
    """

    model_type: str
    read_config: Callable[[Mapping[str, Any]], FamilyConfig]
    cache_groups: Callable[[ModelConfig], tuple[CacheGroup, ...]]
    language_model: str
    vision_tower: str
    media: str
    prompt_format: PromptFormat
    positions: PositionsKind
    bidirectional_items: bool = False
    has_video_token: bool = True
    native_evs_rate: Callable[[Mapping[str, Any]], float] | None = None
    live_sessions: bool = False
    narration_timestamp: str | None = None
    weight_prefixes: Mapping[str, str] = field(default_factory=dict)
    checkpoints: str | None = None
    pixel_budget: tuple[str, ...] = ()
    pixel_stage_refusal: str | None = "its vision tower cannot encode a subset of its tokens"

    def __post_init__(self) -> None:
        if not self.model_type:
            raise ValueError("model_type must be a non-empty string")
        if self.positions not in get_args(PositionsKind):
            raise ValueError(f"positions={self.positions!r}: allowed {get_args(PositionsKind)}")
        for name in ("language_model", "vision_tower", "media", "checkpoints"):
            value = getattr(self, name)
            if name == "checkpoints" and value is None:
                continue
            module, _, attribute = value.partition(":")
            if not module or not attribute:
                raise ValueError(f"{name}={value!r} must be 'module:attribute'")
        if self.live_sessions and not self.has_video_token:
            raise ValueError("live sessions append video placeholders: they need a video token")
        if self.narration_timestamp is not None and not self.live_sessions:
            raise ValueError("narration appends tubelets as live sessions do: it needs those")
        if not all(isinstance(name, str) and name for name in self.pixel_budget):
            raise ValueError(f"pixel_budget={self.pixel_budget!r} must name options as strings")
        object.__setattr__(self, "weight_prefixes", MappingProxyType(dict(self.weight_prefixes)))

    @property
    def num_position_rows(self) -> int:
        """Position ids per token: 3 for M-RoPE's (t, h, w), else 1."""
        return POSITION_ROWS[self.positions]

    def language_model_class(self) -> type:
        return _resolve(self.language_model)

    def vision_tower_class(self) -> type:
        return _resolve(self.vision_tower)

    def media_class(self) -> type:
        return _resolve(self.media)

    def checkpoint_recipe(self) -> Any:
        """The family's `CheckpointRecipe`; ValueError when it names none."""
        if self.checkpoints is None:
            raise ValueError(f"model_type {self.model_type!r} has no test-checkpoint recipe")
        return _resolve(self.checkpoints)

    def with_pixel_budget(self, media: Any, budget: Mapping[str, int]) -> Any:
        """`media` (this family's media object) with a request's pixel budget, checked: a name
        the family does not take is a ValueError that lists the ones it does."""
        unknown = sorted(set(budget) - set(self.pixel_budget))
        if unknown:
            allowed = ", ".join(self.pixel_budget) or "none"
            raise ValueError(
                f"{', '.join(unknown)}: not a pixel budget option of {self.model_type} "
                f"(allowed: {allowed})"
            )
        return media.with_pixel_budget(**budget) if budget else media


class FamilyRegistry:
    """`model_type` -> `ModelFamily`. The one registry lives in `families.FAMILIES`.

    `built_in` maps a `model_type` to its entry as "module:attribute": the module is imported
    on the first `get` of that type, so a process imports the families it uses and no other.
    """

    def __init__(self, built_in: Mapping[str, str] = MappingProxyType({})) -> None:
        self._entries: dict[str, ModelFamily] = {}
        self._pending: dict[str, str] = dict(built_in)

    def register(self, entry: ModelFamily) -> None:
        if entry.model_type in self._entries or entry.model_type in self._pending:
            raise ValueError(f"model_type {entry.model_type!r} is already registered")
        self._entries[entry.model_type] = entry

    def unregister(self, model_type: str) -> None:
        if self._pending.pop(model_type, None) is None:
            del self._entries[model_type]

    @contextlib.contextmanager
    def registered(self, entry: ModelFamily) -> Iterator[ModelFamily]:
        """`entry` registered for the duration of a `with` block."""
        self.register(entry)
        try:
            yield entry
        finally:
            self.unregister(entry.model_type)

    def get(self, model_type: str) -> ModelFamily | None:
        """The entry of `model_type` (its module imported now if it is a pending built-in one),
        None when no family has that type."""
        if model_type in self._pending:
            entry = _resolve(self._pending[model_type])
            assert entry.model_type == model_type, (entry.model_type, model_type)
            self._entries[model_type] = entry
            del self._pending[model_type]
        return self._entries.get(model_type)

    @property
    def model_types(self) -> tuple[str, ...]:
        """Every registered `model_type`, imported or not."""
        return (*self._entries, *self._pending)


def _resolve(name: str) -> Any:
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)
