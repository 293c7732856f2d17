"""A request's pixel budget is read and checked through the family's registry entry: Qwen2.5-VL
takes `min_pixels` / `max_pixels` and resizes as transformers' processor does with them;
Qwen3-VL takes its video processor's whole-clip `size` and per-frame cap, and qwen-vl-utils'
per-video values mapped onto them, and sizes clips as transformers' Qwen3-VL video processor
does with what is in force; a family without a budget, or a name it does not take, is refused
with what is allowed."""

import re

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.models.families import FAMILIES
from stillcut.vision.pipeline import VisionPipeline

TOKEN = 32 * 32  # pixels of one Qwen3-VL merged token


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return VisionPipeline(tiny_checkpoint)


@pytest.mark.parametrize(
    "budget", [{"max_pixels": 64 * 28 * 28}, {"min_pixels": 900 * 28 * 28}, {"max_pixels": 784}]
)
def test_qwen_budget_resizes_as_transformers_does(pipeline, budget):
    family = pipeline.family
    assert family.pixel_budget == ("min_pixels", "max_pixels")
    media = family.with_pixel_budget(pipeline.media, budget)
    in_force = media.pixel_budget()
    assert {name: in_force[name] for name in budget} == budget
    for height, width in ((720, 1280), (480, 640), (1080, 1920)):
        expected = hf_resize(height, width, 28, in_force["min_pixels"], in_force["max_pixels"])
        assert media.frame_resize.size(height, width) == expected
        grid = media.token_grid("video", 4, height, width)
        assert grid == (2, expected[0] // 28, expected[1] // 28)
    assert pipeline.media.pixel_budget() != in_force  # the pipeline's own media is unchanged
    assert media.video_preprocess.key() != pipeline.media.video_preprocess.key()


@pytest.mark.parametrize(
    ("budget", "phrase"),
    [
        ({"max_pixels": 10}, "max_pixels must be an integer in [784, 12845056], got 10"),
        ({"min_pixels": 2.5e5}, "min_pixels must be an integer"),
        ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels=5000 must be <= max_pixels=4000"),
        ({"shortest_edge": 10}, "shortest_edge: not a pixel budget option of qwen2_5_vl "),
    ],
)
def test_bad_budgets_name_the_option_and_what_is_allowed(pipeline, budget, phrase):
    with pytest.raises(ValueError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        pipeline.family.with_pixel_budget(pipeline.media, budget)


def test_a_family_without_a_budget_takes_none():
    gemma = FAMILIES.get("gemma3")
    assert gemma.pixel_budget == ()
    with pytest.raises(ValueError, match=r"max_pixels: not a pixel budget option of gemma3 .*none"):
        gemma.with_pixel_budget(object(), {"max_pixels": 1000})


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def qwen3_pipeline(request):
    """Qwen3-VL's budget, and Qwen3.5's: the same tower and media."""
    return VisionPipeline(cached_checkpoint("tiny", seed=1, family=request.param))


def _transformers_clip_size(in_force, num_frames, height, width, monkeypatch):
    """(height, width) transformers' `Qwen3VLVideoProcessor.resize` gives a clip under the
    budget in force (its parent's resampling, which needs torchvision, stubbed to report the
    size it is asked for)."""
    from transformers.image_utils import SizeDict
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    monkeypatch.setattr(BaseVideoProcessor, "resize", lambda _, image, size, resample: size)
    processor = Qwen3VLVideoProcessor(max_video_tokens=in_force["max_pixels"] // TOKEN)
    size = processor.resize(
        torch.empty(1, 1, 3, 1, 1).expand(1, num_frames, 3, height, width),  # only its shape
        SizeDict(shortest_edge=in_force["shortest_edge"], longest_edge=in_force["longest_edge"]),
        resample=None,
        factor=32,
        temporal_factor=2,
        cap_pixels_per_frame=bool(in_force["cap_pixels_per_frame"]),
    )
    return size.height, size.width


@pytest.mark.parametrize(
    "budget",
    [
        {"longest_edge": 1024 * TOKEN},  # the whole clip's
        {"shortest_edge": 6000 * TOKEN, "cap_pixels_per_frame": 0},
        {"cap_pixels_per_frame": 1, "longest_edge": 4096 * TOKEN},
        {"max_pixels": 96 * TOKEN},  # qwen-vl-utils: each frame's ceiling
        {"total_pixels": 800 * TOKEN},  # qwen-vl-utils: the clip's, a tubelet counted once
        {"min_pixels": 300 * TOKEN, "max_pixels": 600 * TOKEN, "total_pixels": 9000 * TOKEN},
    ],
)
def test_qwen3_budget_sizes_clips_as_transformers_does(qwen3_pipeline, budget, monkeypatch):
    media = qwen3_pipeline.family.with_pixel_budget(qwen3_pipeline.media, budget)
    in_force = media.pixel_budget()
    assert {name: in_force[name] for name in budget} == budget
    for num_frames, height, width in ((8, 720, 1280), (5, 480, 640), (30, 1080, 1920)):
        expected = _transformers_clip_size(in_force, num_frames, height, width, monkeypatch)
        grid = media.token_grid("video", num_frames, height, width)
        assert grid == (-(-num_frames // 2), expected[0] // 32, expected[1] // 32)
    assert qwen3_pipeline.media.pixel_budget() != in_force  # the pipeline's media is unchanged


def test_qwen_vl_utils_values_map_onto_the_processors(qwen3_pipeline):
    family, own = qwen3_pipeline.family, qwen3_pipeline.media
    assert own.pixel_budget()["cap_pixels_per_frame"] == 0  # the tiny checkpoint's config
    utils = family.with_pixel_budget(
        own, {"min_pixels": 300 * TOKEN, "max_pixels": 600 * TOKEN, "total_pixels": 9000 * TOKEN}
    ).pixel_budget()
    assert (utils["shortest_edge"], utils["longest_edge"]) == (300 * TOKEN, 18000 * TOKEN)
    assert utils["cap_pixels_per_frame"] == 1  # qwen-vl-utils always caps each frame
    uncapped = family.with_pixel_budget(own, {"max_pixels": 64 * TOKEN, "cap_pixels_per_frame": 0})
    assert uncapped.pixel_budget()["cap_pixels_per_frame"] == 0
    # a frame's share: at most max_pixels, even where the clip's budget would allow more
    capped = family.with_pixel_budget(own, {"max_pixels": 64 * TOKEN})
    _, height, width = capped.token_grid("video", 4, 720, 1280)
    _, free_height, free_width = own.token_grid("video", 4, 720, 1280)
    assert height * width <= 64 < free_height * free_width


@pytest.mark.parametrize(
    ("budget", "phrase"),
    [
        ({"longest_edge": 10}, "longest_edge must be an integer in [1024, "),
        ({"cap_pixels_per_frame": 2}, "cap_pixels_per_frame must be an integer in [0, 1], got 2"),
        ({"max_pixels": 1 << 40}, "max_pixels must be an integer in [1024, 16777216]"),
        ({"min_pixels": 5000, "shortest_edge": 6000}, "min_pixels and shortest_edge set the same"),
        (
            {"total_pixels": 5000, "longest_edge": 6000},
            "total_pixels and longest_edge set the same",
        ),
        ({"min_pixels": 9000, "total_pixels": 4000}, "min_pixels=9000 must be <= 2 x total_pixels"),
        ({"shortest_edge": 9000, "longest_edge": 4000}, "shortest_edge=9000 must be <= longest"),
        ({"frames": 3}, "frames: not a pixel budget option of {family} (allowed: shortest_edge"),
    ],
)
def test_bad_qwen3_budgets_name_the_option_and_what_is_allowed(qwen3_pipeline, budget, phrase):
    family = qwen3_pipeline.family
    with pytest.raises(ValueError, match=re.escape(phrase.format(family=family.model_type))):
        family.with_pixel_budget(qwen3_pipeline.media, budget)
