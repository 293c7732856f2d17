"""The built-in family registry: each entry is imported on first use of its `model_type`, and
each entry builds its own family's test checkpoints."""

import json
import subprocess
import sys

import pytest

from stillcut.engine.factory import build_checkpoint
from stillcut.engine.models.families import BUILT_IN, FAMILIES
from stillcut.engine.models.registry import FamilyRegistry

FAMILY_PACKAGES = ("qwen2_vl", "gemma3", "nemotron_omni")

# Loads the checkpoint as the service does (engine + vision pipeline) and answers about a clip,
# then lists the family folders whose modules were imported.
LIST_FAMILIES = f"""
import json, sys
parts = [m.split(".") for m in sys.modules if m.startswith("stillcut.engine.models.")]
print(json.dumps(sorted({{p[3] for p in parts if p[3] in {FAMILY_PACKAGES!r}}})))
"""
LOAD_AND_LIST = (
    """
import sys
from stillcut.service.api import VideoLLM
VideoLLM(sys.argv[1]).describe(sys.argv[2], "What happens?", max_tokens=2)
"""
    + LIST_FAMILIES
)


def test_loading_a_qwen2_5_vl_checkpoint_imports_no_other_family(tiny_checkpoint, samples_dir):
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_LIST, str(tiny_checkpoint), str(samples_dir / "pan.mp4")],
        check=True,
        capture_output=True,
        text=True,
    )
    assert json.loads(result.stdout.splitlines()[-1]) == ["qwen2_vl"]


def test_the_engine_and_the_registry_import_no_family():
    probe = "import stillcut.engine.models.families, stillcut.engine.llm_engine\n" + LIST_FAMILIES
    result = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    )
    assert json.loads(result.stdout) == []


def test_a_pending_entry_is_listed_replaced_and_resolved_once():
    registry = FamilyRegistry(BUILT_IN)
    assert set(registry.model_types) == set(BUILT_IN)
    entry = registry.get("gemma3")
    assert entry.model_type == "gemma3" and registry.get("gemma3") is entry
    with pytest.raises(ValueError, match="already registered"):
        registry.register(FAMILIES.get("qwen2_vl"))
    registry.unregister("qwen2_vl")  # never imported: dropped from the pending list
    assert "qwen2_vl" not in registry.model_types and registry.get("qwen2_vl") is None


@pytest.mark.parametrize("model_type", ["qwen2_vl", "gemma3"])
def test_the_factory_builds_each_family_s_checkpoint(model_type, tmp_path):
    folder = build_checkpoint(tmp_path / "model", "tiny", seed=3, family=model_type)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == model_type and config["stillcut_seed"] == 3


def test_an_entry_without_a_recipe_says_so():
    import dataclasses

    entry = dataclasses.replace(FAMILIES.get("qwen2_5_vl"), model_type="toy", checkpoints=None)
    with pytest.raises(ValueError, match="'toy' has no test-checkpoint recipe"):
        entry.checkpoint_recipe()
