"""A checkpoint: its folder (local, or downloaded from the hub) and its config.json, read once.

`open_checkpoint` finds the folder and parses config.json into a `ModelConfig` (its
`model_type` picks the family's registry entry, whose config reader reads the rest). The
engine, the prompt processor, the language model, the loader and the vision pipeline are handed
that one `Checkpoint`; each also takes a folder or hub id, which it opens itself.

This sits above the registry (`models.families`), which `model_config` must not import: the
family entries' config readers import `model_config` for what they return.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from types import MappingProxyType

from stillcut.engine.model_config import CheckpointError, ModelConfig
from stillcut.engine.models.families import FAMILIES

# Files a checkpoint needs: config, weights, tokenizer and chat template (never .bin/.pth).
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
HUB_ETAG_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder and its parsed config.json."""

    folder: Path
    config: ModelConfig


CheckpointLike = Checkpoint | str | PathLike[str]


def open_checkpoint(model: CheckpointLike) -> Checkpoint:
    """`model` as a `Checkpoint`: itself, or a folder or hub id found and its config read."""
    if isinstance(model, Checkpoint):
        return model
    folder = resolve_checkpoint(model)
    return Checkpoint(folder, load_model_config(folder))


def resolve_checkpoint(model: str | PathLike[str]) -> Path:
    """A local checkpoint folder for `model`: an existing folder, or a hub id to download.

    Hub downloads need the hub to be reachable; offline (HF_HUB_OFFLINE=1 or no network) a hub
    id resolves only from the local Hugging Face cache, otherwise this fails at once with a
    CheckpointError that names the id and says to pass a local folder.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; pass a checkpoint folder (with config.json)")
    name = str(model)
    if not _HUB_ID.match(name):
        raise CheckpointError(f"checkpoint folder {name!r} does not exist")
    return _download_from_hub(name)


def _download_from_hub(repo_id: str) -> Path:
    # Imported here: only hub ids need it, and it costs a noticeable import time.
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            etag_timeout=HUB_ETAG_TIMEOUT_S,
            local_files_only=offline,
        )
    except Exception as error:  # any hub or network failure means the same to the user
        summary = (str(error).strip().splitlines() or [""])[0]
        reason = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else summary
        raise CheckpointError(
            f"cannot fetch hub model {repo_id!r}: {reason} ({type(error).__name__}); "
            "pass a local checkpoint folder instead"
        ) from error
    return Path(folder)


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
