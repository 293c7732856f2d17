"""The toy family's tiny checkpoint: a tiny random Qwen2.5-VL one (transformers' classes, the
real Qwen2.5 tokenizer) with three decoder layers (so what is added after the second still
reaches the logits), relabelled, with the deepstack projections added to its weights."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from stillcut.engine.factory import cached_checkpoint
from toy_deepstack import FEATURES, MODEL_TYPE


def build_checkpoint(folder: Path, seed: int = 0) -> Path:
    """Write the checkpoint into `folder` (which must not exist) and return it."""
    shutil.copytree(cached_checkpoint("tiny", seed=seed, text={"num_hidden_layers": 3}), folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "model_type": MODEL_TYPE}))
    weights_file = folder / "model.safetensors"
    weights = load_file(weights_file)
    (merger,) = [n for n in weights if n.endswith("merger.mlp.2.weight")]
    prefix = merger.removesuffix("merger.mlp.2.weight")  # where this layout keeps the tower
    width = weights[merger].shape[0]
    generator = torch.Generator().manual_seed(seed)
    for k in range(len(FEATURES)):
        projection = torch.randn(width, width, generator=generator) / width**0.5
        weights[f"{prefix}deepstack.{k}.weight"] = projection.to(weights[merger].dtype)
    save_file(weights, weights_file, metadata={"format": "pt"})
    return folder
