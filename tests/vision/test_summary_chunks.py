"""How a long video is cut into chunks and its captions into aggregation prompts.

Chunks are whole tubelets of samples, neighbours overlapping by what is asked, the last one
ending with the range; the default length is the longest that fits the prompt's room and the
checkpoint's trained length; a length that cannot fit is refused with what would. A default
EVS rate leaves whole a chunk it would prune to about its first tubelet. Captions
are packed into as few prompts as fit, and a packing that could never finish is refused.
"""

import pytest

from stillcut.engine.admission import RequestTooLong
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.summary.chunks import (
    ChunkingError,
    ChunkLimits,
    checkpoint_hints,
    chunk_evs,
    chunk_frames,
    overlap_frames,
    plan_chunks,
)
from stillcut.vision.summary.rounds import caption_groups


def times(start: float, num_samples: int, fps: float) -> list[float]:
    return [start + k / fps for k in range(num_samples)]


def test_chunks_cover_the_range_in_order_the_last_one_ending_with_it():
    # 41 s at 2 fps: 82 samples; 8-sample (4 s) chunks
    chunks = plan_chunks(times(0.0, 82, 2.0), 0.0, 41.0, 2.0, 8, 8)
    assert len(chunks) == 11
    assert [(c.start_s, c.end_s) for c in chunks[:2]] == [(0.0, 4.0), (4.0, 8.0)]
    assert (chunks[-1].start_s, chunks[-1].end_s, chunks[-1].num_samples) == (40.0, 41.0, 2)
    assert sum(c.num_samples for c in chunks) == 82
    assert all(a.stop_sample == b.first_sample for a, b in zip(chunks, chunks[1:], strict=False))
    assert [c.index for c in chunks] == list(range(11))


def test_overlapping_chunks_share_samples_and_add_at_least_one_each():
    # from 10 s: 20 samples; 8 per chunk, a new one every 6 (2 shared)
    chunks = plan_chunks(times(10.0, 20, 2.0), 10.0, 20.0, 2.0, 8, 6)
    assert [(c.first_sample, c.num_samples) for c in chunks] == [(0, 8), (6, 8), (12, 8)]
    assert [(c.start_s, c.end_s) for c in chunks] == [(10.0, 14.0), (13.0, 17.0), (16.0, 20.0)]
    # a range that ends inside the overlap gets no chunk made only of shared samples
    assert len(plan_chunks(times(0.0, 14, 2.0), 0.0, 7.0, 2.0, 8, 6)) == 2
    assert len(plan_chunks(times(0.0, 15, 2.0), 0.0, 7.5, 2.0, 8, 6)) == 3


def kept(tokens_per_tubelet: int):
    return lambda num_frames: -(-num_frames // 2) * tokens_per_tubelet


def test_the_default_chunk_is_the_longest_that_fits_and_the_checkpoint_trained_on():
    roomy = ChunkLimits(max_video_tokens=10_000, max_chunk_s=4.0)
    assert chunk_frames(None, 2.0, roomy, kept(12)) == 8  # the trained 4 s
    tight = ChunkLimits(max_video_tokens=50, max_chunk_s=30.0)
    assert chunk_frames(None, 2.0, tight, kept(12)) == 8  # 4 tubelets of 12 fit in 50
    markers = ChunkLimits(max_video_tokens=50, max_chunk_s=30.0, marker_tokens_per_frame=4)
    assert chunk_frames(None, 2.0, markers, kept(12)) == 4  # 2 tubelets: 24 + 16 markers
    assert chunk_frames(None, 1.0, ChunkLimits(10_000, 5.0), kept(12)) == 4  # whole tubelets


RATE = EVSConfig(mode="rate", rate=0.75)


def test_a_default_rate_leaves_whole_a_chunk_it_would_prune_to_its_first_tubelet():
    # rate 0.75 keeps max(h*w, int(t*h*w/4)): under 8 tubelets, less than one past the first
    for tubelets in range(1, 8):
        assert chunk_evs(RATE, (tubelets, 4, 6), whole_short=True) is None
    assert chunk_evs(RATE, (8, 4, 6), whole_short=True) == RATE
    assert chunk_evs(RATE, (3, 4, 6), whole_short=False) == RATE  # the caller's rate: as named
    half = EVSConfig(mode="rate", rate=0.5)
    assert chunk_evs(half, (3, 4, 6), whole_short=True) is None
    assert chunk_evs(half, (4, 4, 6), whole_short=True) == half
    threshold = EVSConfig(mode="threshold", threshold=0.3)
    assert chunk_evs(threshold, (2, 4, 6), whole_short=True) == threshold
    assert chunk_evs(None, (2, 4, 6), whole_short=True) is None


def test_the_longest_chunk_that_fits_when_a_longer_one_keeps_fewer_tokens():
    def whole_then_a_quarter(num_frames: int) -> int:  # 12 tokens per tubelet
        tubelets = num_frames // 2
        return 12 * (tubelets if tubelets < 8 else max(1, tubelets // 4))

    limits = ChunkLimits(max_video_tokens=40, max_chunk_s=10.0)
    assert chunk_frames(None, 2.0, limits, whole_then_a_quarter) == 20  # 10 tubelets keep 24
    limits = ChunkLimits(max_video_tokens=40, max_chunk_s=3.5)
    assert chunk_frames(None, 2.0, limits, whole_then_a_quarter) == 6  # 3 whole: 36


def test_a_given_chunk_length_is_rounded_to_tubelets_and_refused_when_it_cannot_fit():
    limits = ChunkLimits(max_video_tokens=100, max_chunk_s=4.0)
    assert chunk_frames(3.0, 2.0, limits, kept(12)) == 6  # over the trained length: as asked
    assert chunk_frames(2.5, 2.0, limits, kept(12)) == 6
    assert chunk_frames(0.2, 2.0, limits, kept(12)) == 2
    with pytest.raises(ChunkingError, match=r"chunk_s=30 keeps up to 360 .* at most chunk_s=8"):
        chunk_frames(30.0, 2.0, limits, kept(12))
    with pytest.raises(ChunkingError, match="one tubelet of this video keeps up to 120"):
        chunk_frames(None, 2.0, limits, kept(120))


def test_overlap_is_whole_frames_under_the_chunk():
    assert overlap_frames(1.0, 2.0, 8) == 2
    assert overlap_frames(0.0, 2.0, 8) == 0
    with pytest.raises(ChunkingError, match="shorter than the chunk"):
        overlap_frames(4.0, 2.0, 8)


def test_checkpoint_hints_are_read_from_its_config():
    raw = {"stillcut_summary": {"chunk_s": 4.0, "captions_per_round": 9, "other": 1}}
    assert checkpoint_hints(raw) == {"chunk_s": 4.0, "captions_per_round": 9}
    assert checkpoint_hints({}) == {}
    with pytest.raises(ValueError, match="must be an object"):
        checkpoint_hints({"stillcut_summary": [4]})


def test_captions_are_packed_into_as_few_prompts_as_fit():
    lines = [10] * 10
    assert caption_groups(lines, 20, 200) == [range(0, 10)]  # 120 tokens: one prompt
    assert caption_groups(lines, 20, 60) == [range(0, 4), range(4, 8), range(8, 10)]
    assert caption_groups(lines, 20, 200, per_round=3) == [
        range(0, 3),
        range(3, 6),
        range(6, 9),
        range(9, 10),
    ]
    assert caption_groups([5, 50, 5], 10, 69) == [range(0, 2), range(2, 3)]


def test_a_packing_that_cannot_finish_is_refused():
    with pytest.raises(RequestTooLong, match="caption 1 needs 80 tokens"):
        caption_groups([10, 70], 10, 60)
    with pytest.raises(RequestTooLong, match="no aggregation prompt holds two captions"):
        caption_groups([30, 30, 30], 10, 60)
    with pytest.raises(ValueError, match="captions_per_round=1"):
        caption_groups([1, 1], 1, 100, per_round=1)
