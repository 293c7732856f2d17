"""The token plan, from the packet index alone, says what encoding then does: the same sample
times and frames, the same grid, in rate mode the exact kept count (a range that holds it in
threshold mode), and when the limits are short, a frame count that fits."""

from fractions import Fraction

import pytest

from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import VideoInput, VisionPipeline
from stillcut.vision.synthetic import moving_texture, write_video
from stillcut.vision.video_plan import PlanLimits, plan_video


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "clip.mp4"
    frames = moving_texture(120, 160, 96, seed=2)
    write_video(path, frames, time_base=Fraction(1, 12), options={"g": "12", "sc_threshold": "0"})
    return path


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return VisionPipeline(tiny_checkpoint, window_frames=8)


@pytest.mark.parametrize(
    "options",
    [
        {"fps": 4.0, "evs": EVSConfig(mode="rate", rate=0.75)},
        {"fps": 0.25, "evs": None, "start": 0.7},  # sparse: samples 4 s apart, keyframes 1 s
        {"num_frames": 7, "evs": EVSConfig(mode="threshold", threshold=0.1, floor=1)},
        {"fps": 3.0, "end": 3.2, "pixels": (("max_pixels", 60 * 28 * 28),), "evs": None},
    ],
)
def test_plan_says_what_encoding_does(pipeline, clip, options):
    spec = VideoInput(clip, max_frames=64, **options)
    plan = plan_video(pipeline, spec)
    item = pipeline.video(clip, max_frames=64, **options)
    assert plan.frame_times == item.timestamps
    assert len(plan.sample_times) == len(item.timestamps)
    assert plan.token_grid == item.llm_grid
    assert plan.tokens_before_evs == item.num_dense_tokens
    assert plan.tokens_after_evs_min <= item.num_tokens <= plan.tokens_after_evs
    if options["evs"] is None or options["evs"].mode == "rate":
        assert plan.evs_exact and plan.tokens_after_evs == item.num_tokens
    assert plan.sampling == ("seek" if options.get("fps") == 0.25 else "dense")
    assert item.stats["start"] == plan.start_s and item.stats["end"] == plan.end_s
    if "pixels" in options:
        assert plan.pixel_budget["max_pixels"] == 60 * 28 * 28
        assert item.stats["pixel_budget"] == plan.pixel_budget
        assert item.stats["resized_width"] * item.stats["resized_height"] <= 60 * 28 * 28


def test_a_plan_over_the_limits_says_how_many_frames_fit(pipeline, clip):
    evs = EVSConfig(mode="rate", rate=0.5)
    spec = VideoInput(clip, fps=4.0, max_frames=64, evs=evs)
    whole = plan_video(pipeline, spec)
    limits = PlanLimits(max_model_len=4096, max_video_tokens=whole.tokens_after_evs // 2)
    short = plan_video(pipeline, spec, limits)
    assert not short.fits and 1 <= short.fitting_num_frames < len(whole.sample_times)
    fitting = VideoInput(clip, num_frames=short.fitting_num_frames, max_frames=64, evs=evs)
    assert plan_video(pipeline, fitting, limits).fits
    more = VideoInput(clip, num_frames=short.fitting_num_frames + 2, max_frames=64, evs=evs)
    assert not plan_video(pipeline, more, limits).fits
    text = pipeline.model_config.raw["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 4
    assert whole.kv_bytes == whole.tokens_after_evs * per_token  # K and V in fp32
