"""Gemma 3 preprocessing against transformers' `Gemma3ImageProcessorPil`, value for value."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from stillcut.engine.models.gemma3.preprocess import (
    Gemma3PreprocessConfig,
    preprocess_frames,
    preprocess_image,
)

# (height, width): down- and upscaling, both aspect ratios, and the target size itself.
SIZES = [(37, 53), (64, 64), (200, 120), (16, 16), (90, 300)]


def write_config(folder, **fields):
    config = {
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": 64, "width": 64},
        **fields,
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


def random_image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "fields",
    [{}, {"resample": 3, "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.25]}],
    ids=["gemma3_bilinear", "bicubic_other_stats"],
)
def test_matches_transformers_for_several_sizes(tmp_path, fields):
    folder = write_config(tmp_path, **fields)
    theirs_processor = Gemma3ImageProcessorPil.from_pretrained(folder)
    config = Gemma3PreprocessConfig.from_checkpoint(folder)
    assert config.resample == fields.get("resample", 2) and config.image_size == 64
    for index, (height, width) in enumerate(SIZES):
        image = random_image(height, width, seed=index)
        theirs = theirs_processor(images=[Image.fromarray(image)], return_tensors="pt")
        ours = preprocess_image(image, config)
        assert ours.shape == (3, 64, 64) and ours.dtype == torch.float32
        assert theirs["pixel_values"].shape == (1, 3, 64, 64)
        assert theirs["num_crops"].tolist() == [0]  # pan-and-scan stays off by default
        assert (ours - theirs["pixel_values"][0]).abs().max().item() < 1e-5


def test_defaults_are_transformers_defaults():
    config = Gemma3PreprocessConfig()
    image = random_image(100, 80, seed=7)
    theirs = Gemma3ImageProcessorPil()(images=[image], return_tensors="pt")["pixel_values"]
    assert config.image_size == 224 and config.resample == Image.Resampling.BILINEAR
    assert (preprocess_image(image) - theirs[0]).abs().max().item() < 1e-5


def test_frames_are_images_one_per_frame(tmp_path):
    config = Gemma3PreprocessConfig.from_checkpoint(write_config(tmp_path))
    frames = np.stack([random_image(48, 80, seed=seed) for seed in range(3)])  # [T, H, W, 3]
    pixels = preprocess_frames(frames, config)
    assert pixels.shape == (3, 3, 64, 64)
    theirs = Gemma3ImageProcessorPil.from_pretrained(tmp_path)(
        images=list(frames), return_tensors="pt"
    )["pixel_values"]
    assert (pixels - theirs).abs().max().item() < 1e-5
    assert torch.equal(pixels[2], preprocess_image(frames[2], config))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"size": {"height": 64, "width": 32}}, "expected a square"),
        ({"do_pan_and_scan": True}, "do_pan_and_scan=true is not supported"),
        ({"do_normalize": False}, "do_normalize=false is not supported"),
        ({"resample": 9}, "resample=9"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std must be a tuple of 3 positive"),
        ({"rescale_factor": 2}, "rescale_factor must lie in"),
    ],
)
def test_unsupported_checkpoint_settings_fail_clearly(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        Gemma3PreprocessConfig.from_checkpoint(write_config(tmp_path, **fields))


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        Gemma3PreprocessConfig.from_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "frames",
    [
        np.zeros((0, 8, 8, 3), np.uint8),
        np.zeros((2, 8, 8, 4), np.uint8),
        np.zeros((2, 8, 8, 3), np.float32),
        np.zeros((8, 8, 3), np.uint8),
    ],
    ids=["no_frames", "rgba", "float", "single_image"],
)
def test_bad_frames_are_rejected(frames):
    with pytest.raises(ValueError, match=r"frames must be uint8 RGB \[T>=1, H, W, 3\]"):
        preprocess_frames(frames)


def test_key_names_every_parameter():
    base = Gemma3PreprocessConfig(image_size=896)
    assert "image_size=896" in base.key() and "resample=2" in base.key()
    assert base.key() == Gemma3PreprocessConfig(image_size=896).key()
    assert base.key() != Gemma3PreprocessConfig(image_size=896, resample=3).key()
