"""Build a checkpoint's vision encoder and load its weights.

The family's registry entry names the encoder class, built from the family's vision config on
the meta device, so no memory is allocated or initialised for weights that the checkpoint
replaces anyway; `load_weights` then assigns the checkpoint's tensors. An encoder may define
`unused_tensors()`: prefixes of stored parts it never reads (skipped at load, as transformers'
own model never reads them), and `matmul_parameters()`: bare parameters it multiplies by (name
-> output-channel axis), stored and quantized like its linear layers. Weights are stored as the
`WeightFormat` says; the tower computes in the format's arithmetic (`WeightFormat.for_tower`:
float32, or bfloat16 on a CPU with bfloat16 dot products), so its linear layers whose weights
are stored otherwise become `WideningLinear`s (the weight widened for each product, one layer
at a time) and its patch embeddings widen theirs the same way (`quantization.widened`, which
reads the `compute_dtype` every module of the tower is given).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.checkpoint import CheckpointLike, open_checkpoint
from stillcut.engine.loader import checkpoint_dtype, load_weights
from stillcut.engine.model_config import ModelConfig
from stillcut.engine.quantization import WeightFormat, matmul_weights, plan_formats, widened

VISION_PREFIX = "visual."


def build_vision_tower(model_config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """A freshly initialised encoder of the checkpoint's family on `device` ("meta" allocates
    nothing)."""
    with torch.device(device):
        return model_config.family.vision_tower_class()(model_config.vision)


def load_vision_tower(
    model: CheckpointLike,
    weight_format: WeightFormat = WeightFormat(),
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The vision encoder of a checkpoint (or its folder or hub id), weights loaded and stored
    as `weight_format` says (default: as the checkpoint stores them), in eval mode."""
    checkpoint = open_checkpoint(model)
    model_config = checkpoint.config
    tower = build_vision_tower(model_config, device="meta")
    unused = getattr(tower, "unused_tensors", lambda: ())()
    extra = getattr(tower, "matmul_parameters", dict)()
    tower_format = weight_format.resolved(checkpoint_dtype(checkpoint)).for_tower()
    formats = plan_formats(tower, tower_format, matmul_weights(tower, extra))
    load_weights(tower, checkpoint, VISION_PREFIX, device=device, unused=unused, formats=formats)
    compute_dtype = tower_format.compute_dtype
    _widen_linears(tower, compute_dtype)
    for module in tower.modules():
        module.compute_dtype = compute_dtype
    return tower.eval()


class WideningLinear(nn.Module):
    """An `nn.Linear` whose weight stays as stored (with its int8 `weight_scale`) and is
    widened to the input's dtype for each product."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        if hasattr(linear, "weight_scale"):
            self.weight_scale = linear.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, widened(self), self.bias)


def _widen_linears(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """Make every `nn.Linear` under `module` whose weight is not stored in `compute_dtype` (an
    int8 one, or a narrower one in a float32 tower) a `WideningLinear`."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and (
            hasattr(child, "weight_scale") or child.weight.dtype != compute_dtype
        ):
            setattr(module, name, WideningLinear(child))
        else:
            _widen_linears(child, compute_dtype)
