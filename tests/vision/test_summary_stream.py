"""A long video's chunks through the tower: each chunk's item is what describing that range
gives, the whole file decoded once (several chunks per tower pass); asked again, the chunks
come from the encoder cache without decoding, and only the stretch it lacks is decoded."""

from fractions import Fraction

import pytest
import torch

from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import VisionPipeline
from stillcut.vision.summary.chunk_stream import ChunkRequest, ChunkStream
from stillcut.vision.summary.chunks import ChunkingError, ChunkLimits
from stillcut.vision.synthetic import moving_texture, write_video

SOURCE_FPS = 8
DURATION_S = 13.0
LIMITS = ChunkLimits(max_video_tokens=10_000, max_chunk_s=30.0)
RATE = EVSConfig(mode="rate", rate=0.5)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("summary") / "clip.mp4"
    frames = moving_texture(round(DURATION_S * SOURCE_FPS), 112, 84, seed=7)
    # a keyframe every 2 s, so a decode may start part-way
    write_video(path, frames, time_base=Fraction(1, SOURCE_FPS), options={"g": "16"})
    return path


@pytest.fixture
def pipeline(tiny_checkpoint):
    return VisionPipeline(tiny_checkpoint, window_frames=16)


def all_chunks(pipeline, request):
    stream = ChunkStream(pipeline, request)
    try:
        plan = stream.open()
        encoded = []
        while (batch := stream.next_batch()) is not None:
            encoded += batch
        return plan, encoded
    finally:
        stream.close()


def assert_same_item(item, expected):
    assert item.timestamps == expected.timestamps
    assert item.grid_thw == expected.grid_thw
    assert item.kept_per_tubelet == expected.kept_per_tubelet
    assert torch.equal(item.coords, expected.coords)
    torch.testing.assert_close(item.embeds, expected.embeds, rtol=1e-5, atol=1e-5)


def test_each_chunk_is_the_item_of_its_range_decoded_once(pipeline, clip, tiny_checkpoint):
    request = ChunkRequest(clip, RATE, LIMITS, chunk_s=4.0, overlap_s=1.0)
    decoded_before = pipeline.work.frames_decoded
    plan, encoded = all_chunks(pipeline, request)
    assert (plan.chunk_s, plan.overlap_s, plan.num_cached) == (4.0, 1.0, 0)
    spans = [(e.chunk.start_s, e.chunk.end_s) for e in encoded]
    assert spans == [(0.0, 4.0), (3.0, 7.0), (6.0, 10.0), (9.0, 13.0)]
    assert pipeline.work.frames_decoded - decoded_before <= DURATION_S * SOURCE_FPS
    assert pipeline.work.tower_passes == 2  # 32 frames in windows of 16: two chunks a pass
    reference = VisionPipeline(tiny_checkpoint)
    for got in encoded:
        chunk = got.chunk
        expected = reference.video(clip, evs=RATE, start=chunk.start_s, end=chunk.end_s)
        assert_same_item(got.item, expected)
        assert got.item.stats["cache_hit"] is False
        assert got.item.stats["start"] == chunk.start_s


def test_asked_again_the_chunks_come_from_the_cache(pipeline, clip):
    request = ChunkRequest(clip, RATE, LIMITS, chunk_s=4.0)
    _, first = all_chunks(pipeline, request)
    decoded, passes = pipeline.work.frames_decoded, pipeline.work.tower_passes
    off = ChunkRequest(clip, None, LIMITS, chunk_s=4.0)  # another EVS setting: same embeddings
    plan, again = all_chunks(pipeline, off)
    assert plan.num_cached == len(again) == len(first) == 4
    assert (pipeline.work.frames_decoded, pipeline.work.tower_passes) == (decoded, passes)
    assert all(e.item.stats["cache_hit"] for e in again)
    assert all(e.item.num_tokens == e.item.num_dense_tokens for e in again)
    _, rate_again = all_chunks(pipeline, request)
    for old, new in zip(first, rate_again, strict=True):
        assert_same_item(new.item, old.item)
        assert new.item.identifier == old.item.identifier


def test_only_the_stretch_the_cache_lacks_is_decoded(pipeline, clip):
    all_chunks(pipeline, ChunkRequest(clip, RATE, LIMITS, chunk_s=4.0, end=8.0))
    fresh = VisionPipeline(pipeline.path, window_frames=16)
    _, expected = all_chunks(fresh, ChunkRequest(clip, RATE, LIMITS, chunk_s=4.0))
    decoded, passes = pipeline.work.frames_decoded, pipeline.work.tower_passes
    plan, encoded = all_chunks(pipeline, ChunkRequest(clip, RATE, LIMITS, chunk_s=4.0))
    assert plan.num_cached == 2  # [0, 4) and [4, 8)
    assert pipeline.work.frames_decoded - decoded <= (DURATION_S - 8.0) * SOURCE_FPS
    assert pipeline.work.tower_passes == passes + 1
    for got, want in zip(encoded, expected, strict=True):
        assert_same_item(got.item, want.item)


def test_the_default_length_fits_and_too_many_chunks_are_refused(pipeline, clip):
    tight = ChunkLimits(max_video_tokens=3 * 20, max_chunk_s=30.0)  # three tubelets' tokens
    plan, encoded = all_chunks(pipeline, ChunkRequest(clip, None, tight))
    assert plan.chunk_s == 3.0 and all(e.item.num_tokens <= 60 for e in encoded)
    with pytest.raises(ChunkingError, match="the video gives 7 chunks of 2 s; at most"):
        all_chunks(pipeline, ChunkRequest(clip, None, LIMITS, chunk_s=2.0, max_chunks=6))
