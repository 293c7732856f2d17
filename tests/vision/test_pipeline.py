"""The video → MultiModalItem pipeline: identities, the encoder cache and EVS on its output."""

import io
from dataclasses import replace

import numpy as np
import pytest
import torch

from stillcut.engine.models.qwen2_vl.preprocess import preprocess_video
from stillcut.engine.multimodal import DRAFT, dense_coords
from stillcut.kernels.evs import EVSConfig, prune
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.encoder_cache import EncodedMedia, EncoderCache
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline


def test_item_is_the_tower_output_of_the_decoded_clip(pipeline, counting, samples_dir):
    path = samples_dir / "moving_object.mp4"
    item = pipeline.video(path)
    decoded = decode_video(path, DecodeConfig())
    prepared = preprocess_video(decoded.frames, decoded.sample_fps, pipeline.video_preprocess)
    with torch.inference_mode():
        (expected,) = pipeline.tower.encode([prepared.patches], [prepared.grid_thw])
    torch.testing.assert_close(item.embeds, expected, rtol=0, atol=0)
    assert item.grid_thw == prepared.grid_thw
    assert item.second_per_grid_ts == pytest.approx(2 / decoded.sample_fps)
    assert list(item.timestamps) == decoded.timestamps
    assert torch.equal(item.coords, dense_coords(*item.llm_grid))
    assert item.num_tokens == item.num_dense_tokens == item.stats["tokens_total"]


def test_path_bytes_and_file_object_share_one_media_key(pipeline, counting, samples_dir):
    path = samples_dir / "scene_cut.mp4"
    data = path.read_bytes()
    items = [pipeline.video(path), pipeline.video(data), pipeline.video(io.BytesIO(data))]
    assert len({item.media_key for item in items}) == 1
    assert len(counting) == 1  # the second and third calls were cache hits
    assert [item.stats["cache_hit"] for item in items] == [False, True, True]
    for item in items[1:]:
        assert torch.equal(item.embeds, items[0].embeds)


def test_any_decode_or_preprocess_change_misses_the_cache(pipeline, counting, samples_dir):
    path = samples_dir / "moving_object.mp4"
    keys = {
        pipeline.video(path).media_key,
        pipeline.video(path, fps=1.0).media_key,
        pipeline.video(path, max_frames=4).media_key,
        pipeline.video(path, start=1.0).media_key,
        pipeline.video(path, end=4.0).media_key,
    }
    assert len(keys) == 5 and len(counting) == 5
    pipeline.video(path, fps=1.0)
    assert len(counting) == 5
    original = pipeline.video_preprocess
    for change in ({"max_pixels": 64 * 28 * 28}, {"image_mean": (0.5, 0.5, 0.5)}):
        pipeline.video_preprocess = replace(original, **change)
        try:
            assert pipeline.video(path).media_key not in keys
        finally:
            pipeline.video_preprocess = original
    assert len(counting) == 7
    frames = np.zeros((4, 56, 56, 3), dtype=np.uint8)
    at_two, at_one = pipeline.video(frames, frames_fps=2.0), pipeline.video(frames, frames_fps=1.0)
    assert at_two.media_key != at_one.media_key
    assert at_two.second_per_grid_ts == 1.0 and at_one.second_per_grid_ts == 2.0


def test_evs_runs_on_the_cached_embeddings_and_changes_the_identifier(
    pipeline, counting, samples_dir
):
    path = samples_dir / "moving_object.mp4"
    dense = pipeline.video(path)
    rate = EVSConfig(mode="rate", rate=0.75)
    pruned = pipeline.video(path, evs=rate)
    tau = pipeline.video(path, evs=EVSConfig(mode="threshold", threshold=0.05))
    assert len(counting) == 1  # EVS settings never re-run the encoder
    assert len({dense.media_key, pruned.media_key, tau.media_key}) == 1
    assert len({dense.identifier, pruned.identifier, tau.identifier}) == 3
    expected = prune(dense.embeds, dense.llm_grid, rate)
    assert torch.equal(pruned.embeds, dense.embeds[expected.kept_index])
    assert torch.equal(pruned.coords, expected.kept_coords)
    assert pruned.kept_per_tubelet == tuple(expected.kept_per_tubelet.tolist())
    assert pruned.num_tokens == sum(pruned.kept_per_tubelet) < dense.num_tokens
    assert pruned.stats["tokens_total"] == dense.num_tokens


def test_static_clip_keeps_exactly_the_first_tubelet(pipeline, counting):
    frame = np.random.default_rng(0).integers(0, 256, (112, 140, 3), dtype=np.uint8)
    frames = np.repeat(frame[None], 8, axis=0)
    item = pipeline.video(frames, evs=EVSConfig(mode="threshold", threshold=0.01), frames_fps=2.0)
    t, h, w = item.llm_grid
    assert t == 4
    assert item.kept_per_tubelet == (h * w, 0, 0, 0)
    assert torch.equal(item.coords, dense_coords(1, h, w))


def test_batch_of_videos_and_an_image_in_one_tower_pass(pipeline, counting, samples_dir):
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (3, 84, 112, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)
    inputs = [
        VideoInput(samples_dir / "pan.mp4", max_frames=6),
        VideoInput(frames, frames_fps=1.0),
        ImageInput(image),
    ]
    together = pipeline.encode(inputs)
    assert len(counting) == 1 and len(counting[0]) == 3
    pipeline.cache.clear()
    alone = [pipeline.encode([spec])[0] for spec in inputs]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a.embeds, b.embeds, rtol=0, atol=1e-5)
        assert a.media_key == b.media_key
    assert together[2].kind == "image" and together[2].grid_thw[0] == 1


def test_encode_cached_answers_only_from_the_cache(pipeline, counting, samples_dir):
    """A miss is None with nothing decoded or encoded; once cached, the items equal
    `encode`'s, EVS applied; a file object (readable once) is always left to `encode`."""
    rate = EVSConfig(mode="rate", rate=0.5)
    data = (samples_dir / "pan.mp4").read_bytes()
    image = np.random.default_rng(2).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    inputs = [VideoInput(data, evs=rate), VideoInput(samples_dir / "pan.mp4"), ImageInput(image)]
    decoded_before = pipeline.work.frames_decoded
    assert pipeline.encode_cached(inputs) is None
    assert counting == [] and pipeline.work.frames_decoded == decoded_before
    encoded = pipeline.encode(inputs)
    cached = pipeline.encode_cached(inputs)
    assert len(counting) == 1 and pipeline.work.frames_decoded > decoded_before
    for a, b in zip(encoded, cached, strict=True):
        assert torch.equal(a.embeds, b.embeds) and torch.equal(a.coords, b.coords)
        assert (a.identifier, a.kept_per_tubelet) == (b.identifier, b.kept_per_tubelet)
    assert [item.stats["cache_hit"] for item in cached] == [True, True, True]
    assert cached[0].num_tokens < cached[1].num_tokens  # EVS ran on the cached embeddings
    assert pipeline.encode_cached([VideoInput(io.BytesIO(data))]) is None


def test_encoder_cache_is_lru_and_bounded_in_bytes():
    def entry(num_tokens):
        return EncodedMedia(torch.zeros(num_tokens, 4), (1, 2, 2), 1.0, (0.0,), {})

    cache = EncoderCache(max_bytes=3 * 16 * 4 * 4)  # three 16-token fp32 entries
    for name in "abc":
        cache.put(name, entry(16))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("d", entry(16))
    assert "b" not in cache and {"a", "c", "d"} <= set(cache._entries)
    assert cache.nbytes <= cache.max_bytes
    cache.put("huge", entry(1000))
    assert "huge" not in cache and cache.nbytes <= cache.max_bytes
    cache.put("e", entry(40))  # evicts two entries to fit
    assert cache.nbytes <= cache.max_bytes and "e" in cache


def test_a_draft_tower_encodes_the_same_input_and_keeps_the_tokens_evs_kept(
    pipeline, tiny_checkpoint, small_draft_checkpoint
):
    """The draft's embeddings are its own tower's over the target's preprocessed frames, at
    the rows the target's EVS kept; one encoder cache holds entries with and without them
    apart, so an entry without them is never served to a drafting pipeline."""
    from stillcut.vision.towers import load_vision_tower

    drafting = VisionPipeline(tiny_checkpoint, draft_model=small_draft_checkpoint)
    drafting.cache = pipeline.cache
    pipeline.cache.clear()
    frames = np.random.default_rng(3).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    spec = VideoInput(frames, evs=EVSConfig(mode="rate", rate=0.5))
    (plain,) = pipeline.encode([spec])
    (item,) = drafting.encode([spec])
    assert DRAFT not in plain.features and not item.stats["cache_hit"]
    assert torch.equal(item.embeds, plain.embeds) and torch.equal(item.coords, plain.coords)
    prepared = preprocess_video(frames, 2.0, pipeline.video_preprocess)
    with torch.inference_mode():
        tower = load_vision_tower(small_draft_checkpoint)
        (dense,) = tower.encode([prepared.patches], [prepared.grid_thw])  # [t * h * w, 24]
    _, height, width = item.llm_grid
    t, h, w = item.coords.unbind(1)
    torch.testing.assert_close(item.features[DRAFT], dense[(t * height + h) * width + w])
    (again,) = drafting.encode([spec])
    assert again.stats["cache_hit"] and torch.equal(again.features[DRAFT], item.features[DRAFT])
    assert DRAFT not in pipeline.encode([spec])[0].features
