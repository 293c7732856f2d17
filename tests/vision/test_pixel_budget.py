"""A request's pixel budget is read and checked through the family's registry entry: Qwen2.5-VL
takes `min_pixels` / `max_pixels` and resizes as transformers' processor does with them; a
family without a budget, or a name it does not take, is refused with what is allowed."""

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

from stillcut.engine.models.families import FAMILIES
from stillcut.vision.pipeline import VisionPipeline


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
