"""Build a vision tower for a checkpoint and load its weights.

The tower is built on the meta device, so no memory is allocated or initialised for weights
that the checkpoint replaces anyway; `load_weights` then assigns the checkpoint's tensors.
"""

from __future__ import annotations

from os import PathLike

import torch

from stillcut.engine.loader import load_model_config, load_weights, resolve_checkpoint
from stillcut.engine.model_config import VisionConfig
from stillcut.vision.qwen2_5_vl import Qwen2_5_VLVisionTower
from stillcut.vision.qwen2_vl import Qwen2VLVisionTower

VISION_PREFIX = "visual."


def build_vision_tower(
    config: VisionConfig, device: torch.device | str = "cpu"
) -> Qwen2VLVisionTower:
    """A freshly initialised tower of `config.family` on `device` ("meta" allocates nothing)."""
    tower_class = {"qwen2_5_vl": Qwen2_5_VLVisionTower, "qwen2_vl": Qwen2VLVisionTower}
    with torch.device(device):
        return tower_class[config.family](config)


def load_vision_tower(
    model: str | PathLike[str],
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
) -> Qwen2VLVisionTower:
    """The vision tower of a checkpoint folder or hub id, weights loaded, in eval mode."""
    path = resolve_checkpoint(model)
    tower = build_vision_tower(load_model_config(path).vision, device="meta")
    load_weights(tower, path, prefix=VISION_PREFIX, dtype=dtype, device=device)
    return tower.eval()
