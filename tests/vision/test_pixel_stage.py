"""EVS before the tower in the pipeline: what it keeps, what the tower encodes, what is cached."""

import numpy as np
import pytest
import torch

from stillcut.engine.models.families import FAMILIES
from stillcut.engine.multimodal import DRAFT, dense_coords
from stillcut.kernels.evs import EVSConfig, prune
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline
from stillcut.vision.pixel_stage import check_pixel_stage

RATE = EVSConfig(mode="rate", rate=0.75, stage="pixels")
THRESHOLD = EVSConfig(mode="threshold", threshold=0.005, stage="pixels")


def moving_frames(count: int = 8, seed: int = 0) -> np.ndarray:
    """A textured still with a bright square that moves right: some tokens change."""
    rng = np.random.default_rng(seed)
    frames = np.repeat(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)[None], count, axis=0)
    for k in range(count):
        frames[k, 28:56, 10 * k : 10 * k + 28] = 255
    return frames


def test_the_tower_encodes_only_what_pixel_evs_keeps(pipeline, counting):
    frames = moving_frames()
    item = pipeline.video(frames, evs=RATE)
    prepared = pipeline.media.prepare_video(frames, 2.0)
    grid = item.llm_grid
    expected = prune(pipeline.media.pixel_features(prepared), grid, RATE)
    (masks,) = counting.kept  # one tower pass
    assert torch.equal(masks[0], expected.mask)
    assert torch.equal(item.coords, expected.kept_coords)
    assert item.kept_per_tubelet == tuple(expected.kept_per_tubelet.tolist())
    assert item.num_tokens == max(grid[1] * grid[2], int(grid[0] * grid[1] * grid[2] * 0.25))
    with torch.inference_mode():
        (kept,) = pipeline.tower.encode([prepared.patches], [prepared.grid_thw], [expected.mask])
    torch.testing.assert_close(item.embeds, kept, rtol=0, atol=0)
    assert item.stats["tokens_total"] == grid[0] * grid[1] * grid[2]


@pytest.mark.parametrize(
    "evs",
    [
        EVSConfig(mode="rate", rate=0.0, stage="pixels"),
        EVSConfig(mode="threshold", threshold=0.0, stage="pixels"),
        EVSConfig(mode="threshold", threshold=0.3, floor=10**6, stage="pixels"),
    ],
)
def test_a_setting_keeping_every_token_takes_the_ordinary_path(pipeline, counting, evs):
    frames = moving_frames()
    dense = pipeline.video(frames)
    pipeline.cache.clear()
    item = pipeline.video(frames, evs=evs)
    assert counting.kept == [None, None]  # the tower ran without masks both times
    assert torch.equal(item.embeds, dense.embeds)
    assert torch.equal(item.coords, dense_coords(*item.llm_grid))


def test_one_tower_pass_mixes_pixel_stage_and_ordinary_inputs(pipeline, counting):
    image = np.random.default_rng(1).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    inputs = [
        VideoInput(moving_frames(), evs=RATE),
        VideoInput(moving_frames(6, seed=2), evs=EVSConfig(mode="rate", rate=0.75)),
        ImageInput(image),
        VideoInput(moving_frames(8, seed=3), evs=THRESHOLD),
    ]
    together = pipeline.encode(inputs)
    assert len(counting) == 1
    masks = counting.kept[0]
    assert masks[0] is not None and masks[1] is None and masks[2] is None
    assert masks[3] is not None
    pipeline.cache.clear()
    for spec, item in zip(inputs, together, strict=True):
        (alone,) = pipeline.encode([spec])
        torch.testing.assert_close(item.embeds, alone.embeds, rtol=0, atol=1e-5)
        assert torch.equal(item.coords, alone.coords)
    assert together[0].num_tokens < together[0].num_dense_tokens
    assert together[3].num_tokens < together[3].num_dense_tokens


def test_cache_entries_and_identifiers_tell_the_stages_apart(pipeline, counting):
    frames = moving_frames()
    after = EVSConfig(mode="rate", rate=0.75)
    before = pipeline.video(frames, evs=RATE)
    post = pipeline.video(frames, evs=after)  # the pixel entry holds kept tokens only: a miss
    again = pipeline.video(frames, evs=RATE)
    other = pipeline.video(frames, evs=EVSConfig(mode="rate", rate=0.5, stage="pixels"))
    assert len(counting) == 3  # `again` was a hit; another pixel setting is its own entry
    assert [i.stats["cache_hit"] for i in (before, post, again, other)] == [0, 0, 1, 0]
    assert len({before.identifier, post.identifier, other.identifier}) == 3
    assert before.media_key == post.media_key == other.media_key
    # a hit gives what the miss gave, and the post-tower entry still serves other settings
    assert torch.equal(again.embeds, before.embeds) and torch.equal(again.coords, before.coords)
    assert again.kept_per_tubelet == before.kept_per_tubelet
    pipeline.video(frames, evs=EVSConfig(mode="threshold", threshold=0.1))
    (cached,) = pipeline.encode_cached([VideoInput(frames, evs=RATE)])
    assert len(counting) == 3 and torch.equal(cached.embeds, before.embeds)


def test_a_windowed_file_keeps_what_the_whole_clip_keeps(tiny_checkpoint, samples_dir):
    """Threshold mode decides window by window; rate mode scores the clip, then encodes."""
    whole = VisionPipeline(tiny_checkpoint)
    windowed = VisionPipeline(tiny_checkpoint, window_frames=4)
    path = samples_dir / "moving_object.mp4"
    for evs in (RATE, THRESHOLD):
        expected = whole.video(path, evs=evs, max_frames=12)
        passes = windowed.work.tower_passes
        item = windowed.video(path, evs=evs, max_frames=12)
        assert torch.equal(item.coords, expected.coords)
        assert item.kept_per_tubelet == expected.kept_per_tubelet
        torch.testing.assert_close(item.embeds, expected.embeds, rtol=0, atol=1e-4)
        assert windowed.work.tower_passes - passes <= 3  # 3 windows; an emptied one is skipped
        hit = windowed.video(path, evs=evs, max_frames=12)
        assert hit.stats["cache_hit"] and torch.equal(hit.embeds, item.embeds)


def test_a_draft_tower_encodes_the_same_kept_tokens(
    pipeline, tiny_checkpoint, small_draft_checkpoint
):
    from stillcut.vision.towers import load_vision_tower

    drafting = VisionPipeline(tiny_checkpoint, draft_model=small_draft_checkpoint)
    frames = moving_frames()
    (item,) = drafting.encode([VideoInput(frames, evs=RATE)])
    prepared = drafting.media.prepare_video(frames, 2.0)
    mask = prune(drafting.media.pixel_features(prepared), item.llm_grid, RATE).mask
    with torch.inference_mode():
        tower = load_vision_tower(small_draft_checkpoint)
        (expected,) = tower.encode([prepared.patches], [prepared.grid_thw], [mask])
    torch.testing.assert_close(item.features[DRAFT], expected, rtol=0, atol=0)
    assert item.features[DRAFT].shape[0] == item.num_tokens


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_qwen3_items_are_the_towers_output_for_the_kept_groups(family):
    """Qwen3-VL's items carry the DeepStack sets of the kept tokens; Qwen3.5 (the same tower
    without DeepStack) carries none."""
    from stillcut.engine.factory import cached_checkpoint

    qwen3 = VisionPipeline(cached_checkpoint("tiny", seed=1, family=family))
    frames = moving_frames()
    item = qwen3.video(frames, evs=RATE)
    prepared = qwen3.media.prepare_video(frames, 2.0)
    mask = prune(qwen3.media.pixel_features(prepared), item.llm_grid, RATE).mask
    with torch.inference_mode():
        (expected,) = qwen3.tower.encode([prepared.patches], [prepared.grid_thw], [mask])
    assert item.num_tokens == int(mask.sum()) < mask.numel()
    assert set(item.features) == set(expected.features)
    assert bool(item.features) == (family == "qwen3_vl")
    for name, rows in expected.features.items():
        torch.testing.assert_close(item.features[name], rows, rtol=0, atol=0)
    torch.testing.assert_close(item.embeds, expected.embeds, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["gemma3", "nemotron_h_omni"])
def test_families_whose_tower_cannot_prune_refuse_the_stage(model_type):
    family = FAMILIES.get(model_type)
    check_pixel_stage(family, EVSConfig(mode="rate", rate=0.75))  # after the tower: fine
    with pytest.raises(ValueError, match=f"stage 'pixels'.*{model_type}.*use stage 'embeddings'"):
        check_pixel_stage(family, RATE)


def test_a_gemma3_pipeline_refuses_the_stage_before_any_work():
    from stillcut.engine.factory import cached_checkpoint

    gemma = VisionPipeline(cached_checkpoint("tiny", family="gemma3"))
    with pytest.raises(ValueError, match="SigLIP"):
        gemma.video(moving_frames(), evs=THRESHOLD)
    assert gemma.work.tower_passes == 0 and gemma.work.frames_decoded == 0
