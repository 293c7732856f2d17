"""Random-init Qwen2.5-VL, Qwen2-VL, Gemma 3 and Nemotron 3 Nano Omni checkpoints in Hugging
Face layout.

Qwen checkpoints carry the real Qwen2.5 tokenizer; Gemma 3 and Nemotron ones a tiny tokenizer
trained offline (`gemma3_tokenizer`, `nemotron_tokenizer`). A `CheckpointSpec` (family, preset,
seed, dtype, text/vision config fields, pixel budgets, Gemma 3's tokens per image or
Nemotron's top-level fields and patch budgets) fully determines a
checkpoint: transformers builds the model after seeding torch, so the same
spec gives the same weights. `build_checkpoint` writes one into a folder; `cached_checkpoint`
keeps one per spec in the user's cache under `<preset>-seed<seed>-<hash of the whole spec>`, so a
spec change never reuses a stale folder. `tiny` builds in seconds for tests; `random-demo` has
the shape the speed benchmarks measure (random weights, marked `stillcut_random_weights` in
config.json). The CLI's default model is not built here: it is the trained demo shipped with
the package (`demo_checkpoint`, from `factory.demo`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shutil
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stillcut.engine.disk_cache import atomic_folder, cache_dir, short_hash
from stillcut.engine.factory.qwen_tokenizer import (
    TOKENIZER_FILES,
    qwen_tokenizer_dir,
    tokenizer_cache_name,
)
from stillcut.engine.factory.streamed import write_streamed
from stillcut.engine.models.families import GEMMA3, NEMOTRON_H_OMNI
from stillcut.engine.models.gemma3 import tokenizer as gemma3_tokenizer
from stillcut.engine.models.gemma3.checkpoint import (
    GENERATION_IDS,
    check_gemma3_spec,
    gemma3_hf_config,
    gemma3_processor_configs,
    gemma3_spec_fields,
    randomize_zero_init,
)
from stillcut.engine.models.nemotron_omni import tokenizer as nemotron_tokenizer
from stillcut.engine.models.nemotron_omni.checkpoint import (
    GENERATION_IDS as NEMOTRON_GENERATION_IDS,
)
from stillcut.engine.models.nemotron_omni.checkpoint import (
    check_nemotron_spec,
    nemotron_hf_config,
    nemotron_processor_configs,
    nemotron_spec_fields,
    randomize_unit_init,
)
from stillcut.engine.models.qwen2_vl.checkpoint import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    PRESETS,
    RANDOM_DEMO,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB_SIZE,
    ProcessorSpec,
    family_vision,
    mrope_section,
    preprocessor_configs,
)

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
]

NEMOTRON = NEMOTRON_H_OMNI.model_type
FAMILIES = ("qwen2_5_vl", "qwen2_vl", GEMMA3.model_type, NEMOTRON)
Family = Literal["qwen2_5_vl", "qwen2_vl", "gemma3", "nemotron_h_omni"]
DTYPES = ("float32", "bfloat16")
FORMAT_VERSION = 1  # bump whenever the files written for an unchanged spec change
_MODEL_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    GEMMA3.model_type: "Gemma3ForConditionalGeneration",
    NEMOTRON: "NemotronH_Omni_Reasoning_V3",
}
_QWEN_GENERATION_IDS = {
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID],
    "pad_token_id": BOS_TOKEN_ID,
}
_TOKENIZER_NAMES = {
    GEMMA3.model_type: gemma3_tokenizer.tokenizer_recipe_name,
    NEMOTRON: nemotron_tokenizer.tokenizer_recipe_name,
}
_GENERATION_IDS = {GEMMA3.model_type: GENERATION_IDS, NEMOTRON: NEMOTRON_GENERATION_IDS}
_RANDOMIZE = {GEMMA3.model_type: randomize_zero_init, NEMOTRON: randomize_unit_init}
_PROCESSOR_CONFIGS = {
    GEMMA3.model_type: gemma3_processor_configs,
    NEMOTRON: nemotron_processor_configs,
}
_TOKENIZER_WRITERS = {
    GEMMA3.model_type: gemma3_tokenizer.write_tokenizer_files,
    NEMOTRON: nemotron_tokenizer.write_tokenizer_files,
}
# Model init draws from torch's global RNG, so builders in one process take turns.
_INIT_LOCK = threading.Lock()
_POSITIVE_TEXT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


@dataclass(frozen=True)
class CheckpointSpec:
    """Everything that determines a built checkpoint. Build one with `checkpoint_spec`.

    `text` and `vision` are the full transformers sub-config fields (vision in the family's own
    keys); treat them as read-only. `processor` applies to the Qwen families,
    `mm_tokens_per_image` (None for Qwen) to Gemma 3, `extra` (top-level config fields and
    processor patch budgets) to Nemotron 3 Nano Omni.
    """

    preset: str
    family: Family
    seed: int
    dtype: Literal["float32", "bfloat16"]
    tie_word_embeddings: bool
    text: dict[str, Any]
    vision: dict[str, Any]
    processor: ProcessorSpec
    mm_tokens_per_image: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: allowed {FAMILIES}")
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
        if self.family == GEMMA3.model_type:
            check_gemma3_spec(self.text, self.vision, self.mm_tokens_per_image)
            return
        if self.family == NEMOTRON:
            check_nemotron_spec(self.text, self.extra)
            return
        if self.extra:
            raise ValueError(f"extra fields apply to {NEMOTRON!r}, not {self.family!r}")
        if self.mm_tokens_per_image is not None:
            raise ValueError(f"mm_tokens_per_image applies to Gemma 3, not {self.family!r}")
        mrope_section = self.text["rope_parameters"].get("mrope_section", ())
        if sum(mrope_section) != hidden // num_heads // 2:
            raise ValueError(
                f"text rope_parameters.mrope_section={mrope_section} must sum to "
                f"head_dim / 2 = {hidden // num_heads // 2}"
            )
        out_key = "out_hidden_size" if self.family == "qwen2_5_vl" else "hidden_size"
        if self.vision[out_key] != hidden:
            raise ValueError(
                f"vision {out_key}={self.vision[out_key]} must equal text hidden_size={hidden}"
            )

    def digest(self) -> str:
        """A short hash of the spec and of everything else that shapes the written files."""
        payload = {
            "spec": dataclasses.asdict(self),
            "format": FORMAT_VERSION,
            "tokenizer": _TOKENIZER_NAMES.get(self.family, tokenizer_cache_name)(),
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
    family: Family = "qwen2_5_vl",
    text: Mapping[str, Any] | None = None,
    vision: Mapping[str, Any] | None = None,
    processor: Mapping[str, int] | None = None,
    tie_word_embeddings: bool | None = None,
    mm_tokens_per_image: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> CheckpointSpec:
    """Resolve a preset and overrides into a full spec.

    `text` and `vision` override transformers config fields (`vision` in the family's keys,
    e.g. `embed_dim`/`mlp_ratio` for Qwen2-VL); `processor` overrides `ProcessorSpec` fields;
    `dtype` and `tie_word_embeddings` default to the preset's (Gemma 3: tied; Nemotron:
    untied, as its releases). Unless overridden, M-RoPE sections follow Qwen's 1:1.5:1.5 split
    of head_dim / 2, and the vision output width follows the text hidden size. Gemma 3 has its
    own presets (`factory.gemma3`), takes `mm_tokens_per_image` and no `processor`; Nemotron 3
    Nano Omni has its own (`factory.nemotron`) and takes `extra`.
    """
    if family == NEMOTRON:
        if processor or mm_tokens_per_image is not None:
            raise ValueError(f"processor and mm_tokens_per_image do not apply to {NEMOTRON!r}")
        fields = nemotron_spec_fields(preset, text, vision, extra)
        return CheckpointSpec(
            preset=preset,
            family=family,
            seed=seed,
            tie_word_embeddings=bool(tie_word_embeddings),
            processor=ProcessorSpec(),
            **{**fields, "dtype": dtype or fields["dtype"]},
        )
    if extra:
        raise ValueError(f"extra fields apply to {NEMOTRON!r}, not {family!r}")
    if family == GEMMA3.model_type:
        if processor:
            raise ValueError("processor overrides apply to the Qwen families, not 'gemma3'")
        fields = gemma3_spec_fields(preset, text, vision, mm_tokens_per_image)
        return CheckpointSpec(
            preset=preset,
            family=family,
            seed=seed,
            tie_word_embeddings=True if tie_word_embeddings is None else tie_word_embeddings,
            processor=ProcessorSpec(),
            **{**fields, "dtype": dtype or fields["dtype"]},
        )
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: allowed {tuple(PRESETS)}")
    base = PRESETS[preset]
    resolved_text = {
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        **base.text,
        **(text or {}),
    }
    num_heads = resolved_text["num_attention_heads"]
    head_dim = resolved_text["hidden_size"] // num_heads if num_heads > 0 else 0  # 0: rejected
    resolved_text.setdefault("max_window_layers", resolved_text["num_hidden_layers"])
    resolved_text.setdefault(
        "rope_parameters",
        {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(head_dim)},
    )
    resolved_vision = family_vision(family, base.vision, resolved_text["hidden_size"])
    return CheckpointSpec(
        preset=preset,
        family=family,
        seed=seed,
        dtype=dtype or base.dtype,
        tie_word_embeddings=(
            base.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        ),
        text=resolved_text,
        vision={**resolved_vision, **(vision or {})},
        processor=ProcessorSpec(**(processor or {})),
        mm_tokens_per_image=mm_tokens_per_image,
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
    `processor`, `tie_word_embeddings`). The folder appears complete or not at all.
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
    """The speed benchmarks' model: the cached `random-demo` checkpoint (110M random
    parameters, the real Qwen2.5 tokenizer), built (a few seconds) if missing."""
    return _ensure_cached(checkpoint_spec(RANDOM_DEMO, seed=seed), announce=True)


def hf_config(spec: CheckpointSpec) -> PreTrainedConfig:
    """The transformers config (`Qwen2_5_VLConfig`, `Qwen2VLConfig`, `Gemma3Config`,
    `NemotronH_Omni_Reasoning_V3_Config`) of `spec`."""
    if spec.family == GEMMA3.model_type:
        return gemma3_hf_config(spec)
    if spec.family == NEMOTRON:
        return nemotron_hf_config(spec)
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    config_class = Qwen2_5_VLConfig if spec.family == "qwen2_5_vl" else Qwen2VLConfig
    return config_class(
        text_config=dict(spec.text),
        vision_config=dict(spec.vision),
        tie_word_embeddings=spec.tie_word_embeddings,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        # Lets the CLI say that the answers come from random weights.
        stillcut_random_weights=True,
        stillcut_preset=spec.preset,
        stillcut_seed=spec.seed,
    )


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

    model_class = getattr(transformers, _MODEL_CLASSES[spec.family])
    generation = transformers.GenerationConfig(
        **_GENERATION_IDS.get(spec.family, _QWEN_GENERATION_IDS)
    )
    preset = PRESETS.get(spec.preset)
    if spec.family in ("qwen2_5_vl", "qwen2_vl") and preset is not None and preset.streamed:
        write_streamed(model_class, hf_config(spec), generation, folder, spec.seed, spec.dtype)
    else:
        _write_built(model_class, spec, generation, folder)
    _write_processing_files(spec, folder)


def _write_built(model_class, spec: CheckpointSpec, generation, folder: Path) -> None:
    """Build the model with transformers' own init (seeded) and save it."""
    import torch
    from transformers.utils import logging as hf_logging

    # fork_rng: seed the init without disturbing the caller's RNG stream.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = model_class(hf_config(spec))
        _RANDOMIZE.get(spec.family, lambda _: None)(model)
    model.to(getattr(torch, spec.dtype))
    model.generation_config = generation
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _write_processing_files(spec: CheckpointSpec, folder: Path) -> None:
    """Preprocessor configs and the tokenizer."""
    if spec.family in _PROCESSOR_CONFIGS:
        configs = _PROCESSOR_CONFIGS[spec.family](spec)
    else:
        configs = preprocessor_configs(spec.family, spec.vision, spec.processor)
    for name, config in configs.items():
        (folder / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if spec.family in _TOKENIZER_WRITERS:
        _TOKENIZER_WRITERS[spec.family](folder)
        return
    tokenizer_folder = qwen_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_folder / name, folder / name)
