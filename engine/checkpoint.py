"""Reading a checkpoint's config.json: its `model_type` picks the family's registry entry,
whose config reader makes the `ModelConfig`.

This sits above the registry (`models.families`), which `model_config` must not import: the
family entries' config readers import `model_config` for what they return.
"""

from __future__ import annotations

import json
from os import PathLike
from pathlib import Path
from types import MappingProxyType

from stillcut.engine.model_config import CheckpointError, ModelConfig
from stillcut.engine.models.families import FAMILIES


def load_model_config(path: str | PathLike[str]) -> ModelConfig:
    """Read `<path>/config.json` (or a config.json path) into a ModelConfig."""
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
