"""The built-in model families: `model_type` -> the family folder's registry entry.

Each entry lives in its family's folder (`engine/models/<family>/entry.py`) and is imported
the first time its `model_type` is looked up, so loading a checkpoint imports its own family
and no other. To add a family, write its folder and register one `ModelFamily`, here or from
your own code with `FAMILIES.register(...)` before loading a checkpoint of it.
"""

from __future__ import annotations

from types import MappingProxyType

from stillcut.engine.models.registry import FamilyRegistry

BUILT_IN = MappingProxyType(
    {
        "qwen2_5_vl": "stillcut.engine.models.qwen2_vl.entry:QWEN2_5_VL",
        "qwen2_vl": "stillcut.engine.models.qwen2_vl.entry:QWEN2_VL",
        "gemma3": "stillcut.engine.models.gemma3.entry:GEMMA3",
        "qwen3_vl": "stillcut.engine.models.qwen3_vl.entry:QWEN3_VL",
        "qwen3_vl_moe": "stillcut.engine.models.qwen3_vl.entry:QWEN3_VL_MOE",
        "qwen3_5": "stillcut.engine.models.qwen3_5.entry:QWEN3_5",
        "qwen3_5_moe": "stillcut.engine.models.qwen3_5.entry:QWEN3_5_MOE",
        "nemotron_h_omni": "stillcut.engine.models.nemotron_omni.entry:NEMOTRON_H_OMNI",
    }
)
# The family the checkpoint factory builds unless told otherwise (its `random-demo` preset
# is the speed benchmarks' model).
DEFAULT_MODEL_TYPE = "qwen2_5_vl"

FAMILIES = FamilyRegistry(BUILT_IN)
