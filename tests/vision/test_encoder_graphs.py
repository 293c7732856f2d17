"""Vision encoder graphs: which towers may be captured and why not, and (on CUDA) that a replay
per shape equals the eager pass with at most `max_shapes` graphs kept."""

from __future__ import annotations

import logging

import pytest
import torch

from stillcut.engine.factory import cached_checkpoint
from stillcut.vision.encoder_graphs import EncoderGraphs, GraphedTower, encoder_graphs_unavailable
from stillcut.vision.pipeline import VisionPipeline
from stillcut.vision.towers import load_vision_tower


@pytest.fixture(scope="module")
def gemma3_path():
    return cached_checkpoint("tiny", family="gemma3")


def test_which_towers_run_eagerly_and_why(tiny_checkpoint, gemma3_path, caplog):
    qwen = load_vision_tower(tiny_checkpoint)
    gemma = load_vision_tower(gemma3_path)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert "does host work" in encoder_graphs_unavailable(qwen, cuda, False)
    assert encoder_graphs_unavailable(gemma, cuda, True) == "enforce_eager is set"
    assert encoder_graphs_unavailable(gemma, cpu, False) == "not on a CUDA device"
    with caplog.at_level(logging.INFO, logger="stillcut.vision.encoder_graphs"):
        pipeline = VisionPipeline(gemma3_path)
    assert "vision encoder runs eagerly (not on a CUDA device); so does EVS" in caplog.text
    assert not isinstance(pipeline.tower, GraphedTower)
    with pytest.raises(ValueError, match="max_shapes=0"):
        EncoderGraphs(gemma.encode, max_shapes=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_encoder_equals_eager_per_shape(gemma3_path):
    tower = load_vision_tower(gemma3_path, device="cuda")
    graphed = GraphedTower(tower, max_shapes=2)
    size = tower.config.image_size
    generator = torch.Generator().manual_seed(0)
    for batch in (1, 2, 3, 1):
        pixels = torch.randn(batch, 3, size, size, generator=generator)
        with torch.inference_mode():
            expected = tower.encode(pixels.cuda())
            torch.testing.assert_close(graphed.encode(pixels), expected, rtol=1e-5, atol=1e-5)
        assert len(graphed.encode.graphs) <= 2
