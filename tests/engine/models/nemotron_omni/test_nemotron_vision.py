"""Nemotron 3 Nano Omni's vision path against transformers: video pixels equal its video
processor's, image patch grids follow its image processor's rules (its own
`get_patch_grid_size`, read from its source: the module imports torchvision), embeddings equal
`get_video_features` / `get_image_features`, and the EVS mask equals
`compute_retention_mask`."""

import ast
import dataclasses
import inspect
import math

import numpy as np
import pytest
import torch

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.models.nemotron_omni.preprocess import image_patch_grid, preprocess_video
from stillcut.kernels.evs import EVSConfig, prune
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.pipeline import VideoInput, VisionPipeline

from .nemotron_reference import NemotronReference

DECODE = DecodeConfig(fps=4.0, max_frames=10)


@pytest.fixture(scope="module")
def setup():
    path = cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    return VisionPipeline(path, decode_config=DECODE), NemotronReference(path)


@pytest.mark.parametrize(
    ("num_frames", "height", "width", "aspect"),
    [(5, 64, 96, True), (4, 100, 37, True), (3, 50, 50, False)],
)
def test_video_pixels_equal_the_video_processor(setup, num_frames, height, width, aspect):
    pipeline, reference = setup
    config = dataclasses.replace(pipeline.media.preprocess, video_maintain_aspect_ratio=aspect)
    frames = np.random.default_rng(num_frames).integers(0, 256, (num_frames, height, width, 3))
    frames = frames.astype(np.uint8)
    ours = preprocess_video(frames, 2.0, config)
    expected = reference.video_processor(
        videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)],
        do_convert_rgb=False,
        do_sample_frames=False,
        video_maintain_aspect_ratio=aspect,
        return_tensors="pt",
    ).pixel_values_videos[0]
    assert ours.pixel_values.shape == expected.shape
    torch.testing.assert_close(ours.pixel_values, expected, atol=1e-6, rtol=0)


def _transformers_grid_function():
    """transformers' `get_patch_grid_size`, compiled from its module's source."""
    from transformers.models import nemotron_h_omni

    module_file = inspect.getfile(nemotron_h_omni).replace(
        "__init__.py", "image_processing_nemotron_h_omni.py"
    )
    tree = ast.parse(open(module_file).read())
    (function,) = [n for n in tree.body if getattr(n, "name", "") == "get_patch_grid_size"]
    namespace = {"math": math}
    exec(compile(ast.Module([function], []), module_file, "exec"), namespace)
    return namespace["get_patch_grid_size"]


def test_image_patch_grids_follow_the_image_processor(setup):
    pipeline, _ = setup
    get_patch_grid_size = _transformers_grid_function()
    base = pipeline.media.preprocess
    for budget in ((16, 256, 4096), (64, 128, 4096), (16, 0, 40), (100, 50, 4096)):
        minimum, maximum, max_model_len = budget
        config = dataclasses.replace(
            base, min_num_patches=minimum, max_num_patches=maximum, max_model_len=max_model_len
        )
        # the processor's budget for one image: the context, capped, then at least the minimum
        num_patches = max((max_model_len - 4) * 4, minimum)
        num_patches = max(min(num_patches, maximum) if maximum else num_patches, minimum)
        for height, width in ((60, 90), (17, 400), (1000, 31), (16, 16), (333, 222), (5, 7)):
            expected = get_patch_grid_size(height, width, 16, 2, minimum, num_patches)
            assert image_patch_grid(height, width, config) == expected, (budget, height, width)


def test_embeddings_and_evs_mask_equal_transformers(setup, samples_dir):
    pipeline, reference = setup
    clip = samples_dir / "pan.mp4"
    item = pipeline.encode([VideoInput(clip)])[0]
    media = reference.video(clip, DECODE)
    with torch.inference_mode():
        (expected,) = reference.model.get_video_features(media["pixel_values_videos"]).pooler_output
    torch.testing.assert_close(item.embeds, expected, atol=1e-4, rtol=0)
    for rate in (0.3, 0.5, 0.75):
        kept = prune(item.embeds, item.llm_grid, EVSConfig(mode="rate", rate=rate)).kept_index
        mask = torch.zeros(item.num_tokens, dtype=torch.bool)
        mask[kept] = True
        assert mask.tolist() == reference.retention(media, rate)

    image = np.random.default_rng(7).integers(0, 256, (70, 130, 3)).astype(np.uint8)
    prepared = pipeline.media.prepare_image(image)
    image_media = reference.image(prepared.pixel_values, prepared.grid_thw[1:])
    with torch.inference_mode():
        (expected,) = reference.model.get_image_features(
            image_media["pixel_values"], image_media["image_grid_hw"]
        ).pooler_output
    torch.testing.assert_close(pipeline.image(image).embeds, expected, atol=1e-4, rtol=0)


def test_the_token_grid_from_sizes_alone_is_the_encoded_one(setup):
    """The service checks a request's cost from headers with `token_grid`, before decoding."""
    pipeline, _ = setup
    rng = np.random.default_rng(8)
    for num_frames, height, width in ((5, 64, 96), (1, 100, 37), (4, 240, 320)):
        frames = rng.integers(0, 256, (num_frames, height, width, 3)).astype(np.uint8)
        item = pipeline.video(frames, frames_fps=2.0)
        assert pipeline.media.token_grid("video", num_frames, height, width) == item.llm_grid
        image = pipeline.image(frames[0])
        assert pipeline.media.token_grid("image", 1, height, width) == image.llm_grid
