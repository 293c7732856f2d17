"""The draft model's vision side, for speculative decoding with a draft model.

The draft checkpoint has the target's preprocessing, patch grid and merge (`check_draft`), so
the target's preprocessed input of a video or image serves the draft's own tower as it is, and
both towers give one embedding per post-merge grid cell in the same order. The pipeline keeps
the draft's embeddings at exactly the rows the target's EVS kept (before the tower, the draft
tower encodes the same kept tokens), so the draft places them at the target's coordinates and
positions. They are as wide as the draft's hidden size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stillcut.engine.checkpoint import open_checkpoint
from stillcut.engine.loader import checkpoint_dtype
from stillcut.engine.model_config import ModelConfig
from stillcut.engine.quantization import WeightFormat
from stillcut.engine.spec_decode.draft import check_draft
from stillcut.vision.encoder_cache import model_fingerprint
from stillcut.vision.encoder_graphs import load_encoder


@dataclass(frozen=True)
class DraftTower:
    """A draft checkpoint's vision encoder and its family's media class (which encodes a
    batch of preprocessed inputs); `key` identifies the draft as stored."""

    path: Path
    tower: nn.Module
    media: Any
    key: str

    @classmethod
    def load(
        cls,
        target_path: Path,
        target_config: ModelConfig,
        model: str | os.PathLike,
        weight_format: WeightFormat,
        device: torch.device,
        enforce_eager: bool,
        max_graph_shapes: int,
    ) -> DraftTower:
        """The draft `model` for the target at `target_path`, its weights in `weight_format`
        (resolved against the draft's checkpoint); raises `DraftMismatch` as the engine does."""
        checkpoint = open_checkpoint(model)
        path, config = checkpoint.folder, checkpoint.config
        check_draft(target_path, target_config, path, config)
        resolved = weight_format.resolved(checkpoint_dtype(checkpoint))
        tower = load_encoder(
            checkpoint,
            resolved,
            device,
            enforce_eager,
            max_graph_shapes,
            role="draft vision encoder",
        )
        media = config.family.media_class()(path, config)
        return cls(path, tower, media, model_fingerprint(checkpoint, resolved.embedding_key()))

    def encode(self, prepared: list, device: torch.device, *kept: list) -> list:
        """The draft tower's output for preprocessed inputs, as its media class's `encode`
        gives it: embeddings [tokens, draft hidden] (or a `TowerOutput`) each; given `kept`
        masks (EVS before the tower), of the same kept tokens as the target's."""
        return self.media.encode(self.tower, prepared, device, *kept)
