"""What the factory's offline-trained tiny tokenizers (Gemma 3's, Nemotron's) share: the files
a checkpoint folder gets, and a recipe name that changes whenever those files would."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stillcut.engine.disk_cache import short_hash


def recipe_name(prefix: str, recipe: Mapping[str, Any]) -> str:
    """`prefix-<hash>` of everything that shapes the files, the tokenizers version included."""
    import tokenizers

    return f"{prefix}-{short_hash({**recipe, 'tokenizers': tokenizers.__version__})}"


def write_tokenizer_files(
    folder: Path, backend: Any, config: Mapping[str, Any], chat_template: str
) -> None:
    """tokenizer.json (the trained `tokenizers.Tokenizer`), tokenizer_config.json and
    chat_template.jinja."""
    backend.save(str(folder / "tokenizer.json"))
    text = json.dumps(config, indent=2, ensure_ascii=False)
    (folder / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
    (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
