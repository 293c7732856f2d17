"""Parity of our video preprocessing with transformers' Qwen2-VL PIL image processor.

transformers' image processor turns one image into one tubelet (the image repeated in time),
so a video is checked one frame at a time: each frame's temporal slice of our patches must equal
that processor's output for the frame alone.
"""

import json

import numpy as np
import pytest
import torch
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf

from stillcut.engine.models.qwen2_vl.preprocess import (
    AspectRatioError,
    PreprocessedVideo,
    VideoPreprocessConfig,
    preprocess_image,
    preprocess_video,
    smart_resize,
)

CONFIG = VideoPreprocessConfig()
# transformers' image default bounds: small frames pass through without a resize.
SMALL = VideoPreprocessConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
TOLERANCE = 1e-5


def random_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), np.uint8)


def hf_patches(frame: np.ndarray, config: VideoPreprocessConfig) -> tuple[np.ndarray, list[int]]:
    """transformers' patches [N, 3, 2, 14, 14] and grid for one [H, W, 3] frame."""
    processor = hf.Qwen2VLImageProcessorPil(
        min_pixels=config.min_pixels, max_pixels=config.max_pixels
    )
    out = processor(images=frame, input_data_format="channels_last")
    pixels = np.asarray(out["pixel_values"])
    shape = (-1, 3, config.temporal_patch_size, config.patch_size, config.patch_size)
    return pixels.reshape(shape), out["image_grid_thw"][0].tolist()


@pytest.mark.parametrize(
    ("num_frames", "height", "width", "config"),
    [
        (4, 56, 84, SMALL),  # a multiple of 28 within bounds: no resize
        (3, 300, 200, SMALL),  # non-square, snapped to 28 multiples
        (3, 101, 77, CONFIG),  # odd sizes
        (3, 20, 30, CONFIG),  # below min_pixels: upscaled
        (2, 1080, 1920, CONFIG),  # above max_pixels: downscaled
    ],
)
def test_each_frame_matches_transformers(
    num_frames: int, height: int, width: int, config: VideoPreprocessConfig
) -> None:
    frames = random_frames(num_frames, height, width)
    video = preprocess_video(frames, sample_fps=2.0, config=config)
    tp = config.temporal_patch_size
    grid_t, grid_h, grid_w = video.grid_thw
    assert grid_t == -(-num_frames // tp)
    assert video.patches.dtype == torch.float32
    assert video.patches.shape == (grid_t * grid_h * grid_w, 3 * tp * 14 * 14)
    assert (video.resized_height, video.resized_width) == (grid_h * 14, grid_w * 14)
    # [t, h*w, 3, tp, 14, 14]
    ours = video.patches.numpy().reshape(grid_t, grid_h * grid_w, 3, tp, 14, 14)
    max_diff = 0.0
    for index in range(num_frames):
        expected, hf_grid = hf_patches(frames[index], config)
        assert hf_grid == [1, grid_h, grid_w]
        got = ours[index // tp, :, :, index % tp]
        max_diff = max(max_diff, float(np.abs(got - expected[:, :, 0]).max()))
    assert max_diff <= TOLERANCE


def test_odd_frame_count_repeats_last_frame() -> None:
    frames = random_frames(3, 56, 84)
    video = preprocess_video(frames, sample_fps=1.0, config=SMALL)
    assert video.grid_thw == (2, 4, 6)
    ours = video.patches.reshape(2, 24, 3, 2, 14, 14)
    torch.testing.assert_close(ours[1, :, :, 1], ours[1, :, :, 0], rtol=0, atol=0)
    # the padded slot holds frame 2, not a copy of the tubelet's frame before it
    assert not torch.equal(ours[0, :, :, 1], ours[1, :, :, 1])


def test_layout_is_time_then_merge_blocks_then_channel_time_patch() -> None:
    # Red encodes the frame, green the patch row, blue the patch column, so a mix-up of any
    # axis of the layout shows up as a wrong value in a slot.
    frames = np.zeros((4, 56, 56, 3), np.uint8)
    frames[..., 0] = (np.arange(4) * 50)[:, None, None]
    frames[..., 1] = (np.arange(56) // 14 * 60)[None, :, None]
    frames[..., 2] = (np.arange(56) // 14 * 60)[None, None, :]
    video = preprocess_video(frames, sample_fps=1.0, config=SMALL)
    assert (video.resized_height, video.resized_width) == (56, 56)
    # [t, h/2, w/2, 2, 2, c, tp, 14, 14]
    ours = video.patches.reshape(2, 2, 2, 2, 2, 3, 2, 14, 14)
    mean = torch.tensor(CONFIG.image_mean)
    std = torch.tensor(CONFIG.image_std)
    levels = ours[..., 0, 0] * std[:, None] + mean[:, None]  # [t, h/2, w/2, 2, 2, c, tp]
    t, hb, wb, mh, mw, tp = torch.meshgrid(*(torch.arange(2),) * 6, indexing="ij")
    expected = torch.stack([50 * (2 * t + tp), 60 * (2 * hb + mh), 60 * (2 * wb + mw)], dim=5)
    torch.testing.assert_close(levels * 255, expected.float(), rtol=0, atol=1e-3)
    assert torch.all(ours == ours[..., :1, :1])


def test_image_matches_transformers_exactly() -> None:
    image = random_frames(1, 101, 77, seed=1)[0]
    ours = preprocess_image(image, CONFIG)
    expected, hf_grid = hf_patches(image, CONFIG)
    assert list(ours.grid_thw) == hf_grid
    assert ours.second_per_grid_ts == 0.0
    diff = np.abs(ours.patches.numpy() - expected.reshape(len(expected), -1)).max()
    assert diff <= TOLERANCE


def test_custom_bounds_and_normalization_match_transformers() -> None:
    config = VideoPreprocessConfig(
        min_pixels=4 * 28 * 28,
        max_pixels=16 * 28 * 28,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    )
    image = random_frames(1, 200, 300, seed=2)[0]
    processor = hf.Qwen2VLImageProcessorPil(
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
    )
    expected = processor(images=image, input_data_format="channels_last")
    ours = preprocess_image(image, config)
    assert list(ours.grid_thw) == expected["image_grid_thw"][0].tolist()
    assert np.abs(ours.patches.numpy() - expected["pixel_values"]).max() <= TOLERANCE


def test_smart_resize_matches_transformers() -> None:
    sizes = [1, 2, 13, 27, 28, 29, 55, 56, 57, 100, 224, 333, 480, 720, 1080, 1920, 4000]
    bounds = [(56 * 56, 28 * 28 * 1280), (CONFIG.min_pixels, CONFIG.max_pixels), (784, 784)]
    for height in sizes:
        for width in sizes:
            if max(height, width) / min(height, width) > 200:
                continue
            for min_pixels, max_pixels in bounds:
                expected = hf.smart_resize(height, width, 28, min_pixels, max_pixels)
                assert smart_resize(height, width, 28, min_pixels, max_pixels) == expected


@pytest.mark.parametrize(("height", "width"), [(1, 201), (2000, 9)])
def test_smart_resize_rejects_extreme_aspect_ratio(height: int, width: int) -> None:
    with pytest.raises(ValueError):
        hf.smart_resize(height, width)
    with pytest.raises(AspectRatioError, match="aspect ratio"):
        smart_resize(height, width)
    with pytest.raises(AspectRatioError):
        preprocess_video(np.zeros((1, height, width, 3), np.uint8), sample_fps=1.0)


def test_second_per_grid_ts() -> None:
    frames = random_frames(2, 28, 28)
    assert preprocess_video(frames, sample_fps=2.0).second_per_grid_ts == 1.0
    assert preprocess_video(frames, sample_fps=0.5).second_per_grid_ts == 4.0
    config = VideoPreprocessConfig(temporal_patch_size=1)
    video = preprocess_video(frames, sample_fps=4.0, config=config)
    assert video.second_per_grid_ts == 0.25
    assert video.grid_thw[0] == 2
    for fps in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="sample_fps"):
            preprocess_video(frames, sample_fps=fps)


@pytest.mark.parametrize(
    "frames",
    [
        np.zeros((2, 28, 28, 3), np.float32),
        np.zeros((28, 28, 3), np.uint8),
        np.zeros((0, 28, 28, 3), np.uint8),
        np.zeros((1, 28, 28, 4), np.uint8),
    ],
)
def test_rejects_malformed_frames(frames: np.ndarray) -> None:
    with pytest.raises(ValueError, match="frames must be uint8 RGB"):
        preprocess_video(frames, sample_fps=1.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"patch_size": 0}, "patch_size"),
        ({"temporal_patch_size": 2.0}, "temporal_patch_size"),
        ({"merge_size": True}, "merge_size"),
        ({"min_pixels": 0}, "min_pixels"),
        ({"min_pixels": 1000, "max_pixels": 999}, "max_pixels"),
        ({"image_mean": (0.5, 0.5)}, "image_mean"),
        ({"image_mean": [0.5, 0.5, 0.5]}, "image_mean"),
        ({"image_std": (0.5, 0.0, 0.5)}, "image_std"),
        ({"rescale_factor": 0.0}, "rescale_factor"),
        ({"rescale_factor": float("nan")}, "rescale_factor"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must"):
        VideoPreprocessConfig(**kwargs)


def write_json(path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_from_checkpoint_reads_pixel_keys(tmp_path) -> None:
    write_json(
        tmp_path / "preprocessor_config.json",
        {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.25, 0.25, 0.25],
            "image_processor_type": "Qwen2VLImageProcessor",
        },
    )
    config = VideoPreprocessConfig.from_checkpoint(tmp_path)
    assert (config.min_pixels, config.max_pixels) == (3136, 12845056)
    assert config.image_mean == (0.5, 0.5, 0.5)
    assert config.image_std == (0.25, 0.25, 0.25)
    assert config.rescale_factor == 1 / 255


def test_from_checkpoint_prefers_video_file_and_reads_size_keys(tmp_path) -> None:
    write_json(tmp_path / "preprocessor_config.json", {"min_pixels": 3136, "patch_size": 14})
    write_json(
        tmp_path / "video_preprocessor_config.json",
        {
            "size": {"shortest_edge": 4096, "longest_edge": 25165824},
            "patch_size": 16,
            "rescale_factor": 0.00392156862745098,
            "fps": 2,
        },
    )
    config = VideoPreprocessConfig.from_checkpoint(str(tmp_path))
    assert (config.min_pixels, config.max_pixels) == (4096, 25165824)
    assert config.patch_size == 16
    assert config.factor == 32


def test_from_checkpoint_top_level_pixels_win_over_size(tmp_path) -> None:
    write_json(
        tmp_path / "preprocessor_config.json",
        {"size": {"shortest_edge": 100, "longest_edge": 200}, "max_pixels": 5000},
    )
    config = VideoPreprocessConfig.from_checkpoint(tmp_path)
    assert (config.min_pixels, config.max_pixels) == (100, 5000)


def test_from_checkpoint_defaults_and_errors(tmp_path) -> None:
    assert VideoPreprocessConfig.from_checkpoint(tmp_path) == VideoPreprocessConfig()
    with pytest.raises(FileNotFoundError):
        VideoPreprocessConfig.from_checkpoint(tmp_path / "missing")
    write_json(tmp_path / "preprocessor_config.json", {"do_normalize": False})
    with pytest.raises(ValueError, match="do_normalize"):
        VideoPreprocessConfig.from_checkpoint(tmp_path)


def test_key_is_stable_and_covers_every_parameter() -> None:
    base = VideoPreprocessConfig()
    assert base.key() == VideoPreprocessConfig().key()
    variants = [
        VideoPreprocessConfig(patch_size=16),
        VideoPreprocessConfig(temporal_patch_size=1),
        VideoPreprocessConfig(merge_size=1),
        VideoPreprocessConfig(min_pixels=base.min_pixels + 1),
        VideoPreprocessConfig(max_pixels=base.max_pixels + 1),
        VideoPreprocessConfig(image_mean=(0.5, 0.5, 0.5)),
        VideoPreprocessConfig(image_std=(0.5, 0.5, 0.5)),
        VideoPreprocessConfig(rescale_factor=1 / 256),
    ]
    keys = {base.key()} | {variant.key() for variant in variants}
    assert len(keys) == len(variants) + 1


def test_result_is_a_frozen_record() -> None:
    video = preprocess_video(random_frames(1, 28, 28), sample_fps=1.0)
    assert isinstance(video, PreprocessedVideo)
    with pytest.raises(AttributeError):
        video.resized_height = 1


def test_one_usable_cpu_gives_the_same_patches_as_many(monkeypatch) -> None:
    """Tubelets run on a thread pool when several CPUs are usable, one after another on one."""
    import stillcut.engine.models.qwen2_vl.preprocess as preprocess

    frames = random_frames(6, 56, 84)
    many = preprocess_video(frames, sample_fps=1.0, config=SMALL)
    monkeypatch.setattr(preprocess, "_usable_cpus", lambda: 1)
    one = preprocess_video(frames, sample_fps=1.0, config=SMALL)
    assert one.grid_thw == many.grid_thw == (3, 4, 6)
    assert torch.equal(one.patches, many.patches)
