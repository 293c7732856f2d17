"""Our Qwen2-VL / Qwen2.5-VL vision towers against transformers' own, on tiny random checkpoints.

The checkpoints are built and saved by transformers, loaded by our loader, and both towers see
the same patches; embeddings must agree to 1e-4 in fp32 (outputs are O(1): the weights are
initialised with std 0.1 so that a wrong window or position would show).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.vision_utils import get_vision_window_index

from stillcut.engine.models.qwen2_vl.tower_2_5 import window_layout
from stillcut.vision.towers import load_vision_tower

TOLERANCE = 1e-4
PATCH_DIM = 3 * 2 * 14 * 14
TINY_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
}
TINY_VISION = {
    "qwen2_5_vl": {
        "depth": 4,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 48,
        "out_hidden_size": 32,
        "fullatt_block_indexes": [1, 3],
        "window_size": 112,
        "initializer_range": 0.1,
    },
    "qwen2_vl": {
        "depth": 3,
        "embed_dim": 32,
        "hidden_size": 32,
        "num_heads": 2,
        "mlp_ratio": 2,
        "initializer_range": 0.1,
    },
}
MODEL_CLASSES = {
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
}
# (t, h, w) in patches. Windows are 4x4 merged tokens = 8x8 patches.
VIDEO_GRIDS = {
    "square": (2, 16, 16),
    "non_square": (1, 8, 20),
    "width_not_window_multiple": (2, 12, 10),
    "odd_tubelets": (3, 8, 12),  # e.g. 5 frames, the last repeated to fill a tubelet
}


@pytest.fixture(scope="module", params=list(MODEL_CLASSES))
def checkpoint(request, tmp_path_factory):
    """(transformers model, our tower) sharing one saved tiny random checkpoint."""
    family = request.param
    config_class, model_class = MODEL_CLASSES[family]
    torch.manual_seed(0)
    config = config_class(vision_config=TINY_VISION[family], text_config=TINY_TEXT)
    model = model_class(config).eval()
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder)
    return model, load_vision_tower(folder)


def random_patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=generator)


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert theirs.abs().max() > 0.5  # the tolerance below means something
    assert (ours - theirs).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("case", list(VIDEO_GRIDS))
@torch.inference_mode()
def test_video_matches_transformers(checkpoint, case):
    model, tower = checkpoint
    grid = VIDEO_GRIDS[case]
    patches = random_patches(grid, seed=1)
    (theirs,) = model.model.get_video_features(patches, torch.tensor([grid])).pooler_output
    (ours,) = tower.encode([patches], [grid])
    assert_close(ours, theirs)
    assert ours.shape == (grid[0] * grid[1] * grid[2] // 4, 32)


@torch.inference_mode()
def test_forward_has_transformers_signature(checkpoint):
    model, tower = checkpoint
    grid_thw = torch.tensor([VIDEO_GRIDS["square"], VIDEO_GRIDS["non_square"]])
    patches = random_patches((1, int(grid_thw.prod(-1).sum()), 1), seed=2)
    theirs = model.model.visual(patches, grid_thw=grid_thw).pooler_output
    assert_close(tower(patches, grid_thw), theirs)


@torch.inference_mode()
def test_image_from_transformers_processor_matches(checkpoint):
    model, tower = checkpoint
    pixels = np.random.default_rng(0).integers(0, 256, (90, 150, 3), dtype=np.uint8)
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)
    inputs = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
    grid = tuple(inputs["image_grid_thw"][0].tolist())
    assert grid[0] == 1  # one picture is repeated to fill a tubelet
    (theirs,) = model.model.get_image_features(
        inputs["pixel_values"], inputs["image_grid_thw"]
    ).pooler_output
    (ours,) = tower.encode([inputs["pixel_values"]], [grid])
    assert_close(ours, theirs)


@torch.inference_mode()
def test_batch_of_videos_in_one_pass_equals_each_alone(checkpoint):
    model, tower = checkpoint
    grids = [(2, 16, 16), (3, 8, 12), (1, 12, 10)]
    patches = [random_patches(grid, seed=10 + i) for i, grid in enumerate(grids)]
    batched = tower.encode(patches, grids)
    theirs = model.model.get_video_features(torch.cat(patches), torch.tensor(grids)).pooler_output
    assert len(batched) == len(grids)
    for ours, one_patches, grid, reference in zip(batched, patches, grids, theirs, strict=True):
        (alone,) = tower.encode([one_patches], [grid])
        assert (ours - alone).abs().max().item() < TOLERANCE
        assert_close(ours, reference)


def test_bad_inputs_are_rejected(checkpoint):
    _, tower = checkpoint
    with pytest.raises(ValueError, match="patches shape"):
        tower.encode([torch.zeros(10, PATCH_DIM)], [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples of 2"):
        tower.encode([torch.zeros(15, PATCH_DIM)], [(1, 3, 5)])
    with pytest.raises(ValueError, match="2 grids"):
        tower.encode([torch.zeros(16, PATCH_DIM)], [(1, 4, 4), (1, 4, 4)])


@pytest.mark.parametrize(
    "grids",
    [[(1, 16, 16)], [(2, 12, 10)], [(1, 2, 2)], [(3, 18, 26), (1, 8, 8), (2, 10, 34)]],
)
def test_window_layout_equals_transformers(grids):
    theirs_order, theirs_cu = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=2, window_size=112, patch_size=14
    )
    order, cu_seqlens = window_layout(grids, merge_size=2, window=4)
    assert torch.equal(order, theirs_order)
    assert torch.equal(cu_seqlens, theirs_cu)
