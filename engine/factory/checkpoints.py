"""Random-init checkpoints of any registered family in Hugging Face layout.

A `CheckpointSpec` (family, preset, seed, dtype, text and vision config fields, and the
family's own options) fully determines a checkpoint: transformers builds the model after
seeding torch, so the same spec gives the same weights. What differs between families is the
family's `CheckpointRecipe` (its presets, config, processor files and tokenizer), which its
registry entry names. `build_checkpoint` writes one into a folder; `cached_checkpoint` keeps
one per spec in the user's cache under `<preset>-seed<seed>-<hash of the whole spec>`, so a
spec change never reuses a stale folder. `tiny` builds in seconds for tests; `random-demo` has
the shape the speed benchmarks measure (random weights, marked `stillcut_random_weights` in
config.json). The CLI's default model is not built here: it is the trained demo shipped with
the package (`stillcut.demo`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stillcut.disk_cache import atomic_folder, cache_dir, short_hash
from stillcut.engine.factory.recipe import RANDOM_DEMO, CheckpointRecipe
from stillcut.engine.factory.streamed import write_streamed
from stillcut.engine.models.families import DEFAULT_MODEL_TYPE, FAMILIES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = [
    "CheckpointSpec",
    "build_checkpoint",
    "cache_dir",
    "cached_checkpoint",
    "checkpoint_spec",
    "hf_config",
    "random_demo_checkpoint",
    "recipe_of",
]

DTYPES = ("float32", "bfloat16")
FORMAT_VERSION = 2  # bump whenever the files written for an unchanged spec change
# Model init draws from torch's global RNG, so builders in one process take turns.
_INIT_LOCK = threading.Lock()
_POSITIVE_TEXT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def recipe_of(family: str) -> CheckpointRecipe:
    """The `CheckpointRecipe` of a registered `model_type`."""
    entry = FAMILIES.get(family)
    if entry is None:
        raise ValueError(f"family={family!r}: allowed {FAMILIES.model_types}")
    return entry.checkpoint_recipe()


@dataclass(frozen=True)
class CheckpointSpec:
    """Everything that determines a built checkpoint. Build one with `checkpoint_spec`.

    `text` and `vision` are the full transformers sub-config fields (vision in the family's own
    keys); `options` the family's own fields (its recipe's `option_names`); treat all three as
    read-only.
    """

    preset: str
    family: str
    seed: int
    dtype: Literal["float32", "bfloat16"]
    tie_word_embeddings: bool
    text: dict[str, Any]
    vision: dict[str, Any]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        recipe = recipe_of(self.family)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: allowed {DTYPES}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed}: allowed 0 <= seed < 2**63")
        for field in _POSITIVE_TEXT_FIELDS:
            if not self.text[field] > 0:
                raise ValueError(f"text {field}={self.text[field]}: must be > 0")
        hidden, num_heads = self.text["hidden_size"], self.text["num_attention_heads"]
        num_kv_heads = self.text["num_key_value_heads"]
        if hidden % num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"text hidden_size={hidden}, num_attention_heads={num_heads}, "
                f"num_key_value_heads={num_kv_heads}: num_attention_heads must divide "
                "hidden_size and num_key_value_heads must divide num_attention_heads"
            )
        recipe.check(self)

    def digest(self) -> str:
        """A short hash of the spec and of everything else that shapes the written files."""
        payload = {
            "spec": dataclasses.asdict(self),
            "format": FORMAT_VERSION,
            "tokenizer": recipe_of(self.family).tokenizer_name(),
            "torch": importlib.metadata.version("torch"),
            "transformers": importlib.metadata.version("transformers"),
        }
        return short_hash(payload)

    def folder_name(self) -> str:
        """The cache folder name: preset, seed and digest."""
        return f"{self.preset}-seed{self.seed}-{self.digest()}"


def checkpoint_spec(
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] | None = None,
    family: str = DEFAULT_MODEL_TYPE,
    text: Mapping[str, Any] | None = None,
    vision: Mapping[str, Any] | None = None,
    tie_word_embeddings: bool | None = None,
    **options: Any,
) -> CheckpointSpec:
    """Resolve a family's preset and overrides into a full spec.

    `text` and `vision` override transformers config fields (`vision` in the family's keys,
    as its recipe documents); `options` are the family's own (its recipe's `option_names`,
    e.g. processor pixel budgets or image token counts); `dtype` and
    `tie_word_embeddings` default to the preset's.
    """
    recipe = recipe_of(family)
    if preset not in recipe.presets:
        raise ValueError(
            f"preset={preset!r} for family {family!r}: allowed {tuple(recipe.presets)}"
        )
    for name, value in options.items():
        if name not in recipe.option_names and value is not None:
            allowed = recipe.option_names or "none"
            raise ValueError(f"{name} does not apply to family {family!r} (its options: {allowed})")
    base = recipe.presets[preset]
    fields = recipe.resolve(preset, text or {}, vision or {}, options)
    return CheckpointSpec(
        preset=preset,
        family=family,
        seed=seed,
        dtype=dtype or base.dtype,
        tie_word_embeddings=(
            base.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        ),
        **fields,
    )


def build_checkpoint(
    path: str | Path,
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-init checkpoint into `path` (new or empty) and return it.

    `overrides` are `checkpoint_spec`'s keyword arguments (`family`, `text`, `vision`,
    `tie_word_embeddings` and the family's options). The folder appears complete or not at
    all.
    """
    spec = checkpoint_spec(preset, seed=seed, dtype=dtype, **overrides)
    folder = Path(path)
    with atomic_folder(folder, exist_ok=False) as partial:
        _write_checkpoint(spec, partial)
    return folder


def cached_checkpoint(
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16"] | None = None,
    **overrides: Any,
) -> Path:
    """The cached checkpoint for this spec under `cache_dir()`, built when missing."""
    return _ensure_cached(checkpoint_spec(preset, seed=seed, dtype=dtype, **overrides))


def random_demo_checkpoint(seed: int = 0) -> Path:
    """The speed benchmarks' model: the default family's cached `random-demo` checkpoint
    (110M random parameters, a real tokenizer), built (a few seconds) if missing."""
    return _ensure_cached(checkpoint_spec(RANDOM_DEMO, seed=seed), announce=True)


def hf_config(spec: CheckpointSpec) -> PreTrainedConfig:
    """The transformers config of `spec`, as its family's recipe writes it."""
    return recipe_of(spec.family).hf_config(spec)


def _ensure_cached(spec: CheckpointSpec, *, announce: bool = False) -> Path:
    folder = cache_dir() / "checkpoints" / spec.folder_name()
    if not folder.is_dir():
        if announce:
            print(f"stillcut: building the {spec.preset} checkpoint in {folder}", file=sys.stderr)
        with atomic_folder(folder, exist_ok=True) as partial:
            _write_checkpoint(spec, partial)
    return folder


def _write_checkpoint(spec: CheckpointSpec, folder: Path) -> None:
    import transformers

    recipe = recipe_of(spec.family)
    model_class = getattr(transformers, recipe.model_class)
    generation = transformers.GenerationConfig(**recipe.generation_ids)
    if recipe.presets[spec.preset].streamed:
        write_streamed(model_class, hf_config(spec), generation, folder, spec.seed, spec.dtype)
    else:
        _write_built(model_class, recipe, spec, generation, folder)
    for name, config in recipe.processor_files(spec).items():
        (folder / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    recipe.write_tokenizer(folder)


def _write_built(
    model_class, recipe: CheckpointRecipe, spec: CheckpointSpec, generation, folder: Path
) -> None:
    """Build the model with transformers' own init (seeded) and save it."""
    import torch
    from transformers.utils import logging as hf_logging

    # fork_rng: seed the init without disturbing the caller's RNG stream.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_class(recipe.hf_config(spec))
        recipe.randomize(model)
    model.to(getattr(torch, spec.dtype))
    model.generation_config = generation
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
