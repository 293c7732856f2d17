"""Build a checkpoint's vision encoder and load its weights.

The family's registry entry names the encoder class, built from the family's vision config on
the meta device, so no memory is allocated or initialised for weights that the checkpoint
replaces anyway; `load_weights` then assigns the checkpoint's tensors. An encoder may define
`unused_tensors()`: prefixes of stored parts it never reads (skipped at load, as transformers'
own model never reads them).
"""

from __future__ import annotations

from os import PathLike

import torch
from torch import nn

from stillcut.engine.loader import load_model_config, load_weights, resolve_checkpoint
from stillcut.engine.model_config import ModelConfig

VISION_PREFIX = "visual."


def build_vision_tower(model_config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """A freshly initialised encoder of the checkpoint's family on `device` ("meta" allocates
    nothing)."""
    with torch.device(device):
        return model_config.family.vision_tower_class()(model_config.vision)


def load_vision_tower(
    model: str | PathLike[str],
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The vision encoder of a checkpoint folder or hub id, weights loaded, in eval mode."""
    path = resolve_checkpoint(model)
    model_config = load_model_config(path)
    tower = build_vision_tower(model_config, device="meta")
    unused = getattr(tower, "unused_tensors", lambda: ())()
    load_weights(tower, path, prefix=VISION_PREFIX, dtype=dtype, device=device, unused=unused)
    return tower.eval()
