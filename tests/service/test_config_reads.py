"""A checkpoint's config.json is read once while a `VideoLLM` is built: the engine, the prompt
processor, the language model, the vision pipeline and its tower share one parsed description
(`engine.checkpoint.Checkpoint`)."""

from __future__ import annotations

import builtins
import io
from pathlib import Path

from stillcut.service.api import VideoLLM

from .conftest import ENGINE_CONFIG


def test_building_a_videollm_reads_config_json_once(tiny_checkpoint, monkeypatch):
    opened = []
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, str | Path) and Path(file).name == "config.json":
            opened.append(Path(file))
        return real_open(file, *args, **kwargs)

    # pathlib opens through `io.open`, json.load(open(...)) through the builtin
    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    VideoLLM(tiny_checkpoint, engine_config=ENGINE_CONFIG)
    assert opened == [tiny_checkpoint / "config.json"]
