"""Narrating a file streams it: frames are decoded as the narration takes them (its memory:
`test_long_video_memory`), and the segments are those of narrating the whole file decoded up
front (what narration did before it streamed). The duration cap narration had (600 s) is gone:
a longer file is narrated."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from stillcut.service.api import VideoLLM
from stillcut.service.narrate_api import file_frames
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import ENGINE_CONFIG, make_llm


@pytest.mark.parametrize("fps", [2.0, 5.0], ids=["each-frame", "frames-repeated"])
def test_a_streamed_file_narrates_as_the_whole_file_decoded_up_front(
    tiny_checkpoint, tmp_path, fps
):
    path = tmp_path / "clip.mp4"
    write_video(path, moving_texture(14, 112, 84, seed=11), time_base=Fraction(1, 4))
    # what narration decoded before it streamed: the whole file, at most 600 s
    whole = decode_video(path, DecodeConfig(fps=fps, max_frames=int(600 * fps), max_duration_s=600))
    streamed = list(file_frames(path, fps))
    assert [t for t, _ in streamed] == whole.timestamps
    assert all(np.array_equal(a, b) for (_, a), b in zip(streamed, whole.frames, strict=True))
    llm = make_llm(tiny_checkpoint)
    # sampled tokens (seeded): the texts tell the two apart if anything differs
    options = {"fps": fps, "max_tokens_per_segment": 4, "temperature": 1.0, "seed": 3}
    options["threshold"] = 0.05
    ours = list(llm.narrate(path, "Say what you see.", **options))
    reference = zip(whole.timestamps, whole.frames, strict=True)
    theirs = list(llm.narrate(iter(reference), "Say what you see.", **options))
    assert len(ours) == len(whole.timestamps) // 2 and any(s.text for s in ours)
    assert [(s.t, s.text, s.kept_tokens, s.prefill_tokens) for s in ours] == [
        (s.t, s.text, s.kept_tokens, s.prefill_tokens) for s in theirs
    ]


def test_a_file_longer_than_ten_minutes_is_narrated(tiny_checkpoint, tmp_path):
    """Past the 600 s narration had as a cap, and past the engine's visual-token limit (512
    here; 31 tubelets of up to 20 tokens): the narration rolls over instead of failing."""
    path = tmp_path / "long.mp4"  # 62 frames, one every 10 s: 620 s
    write_video(path, moving_texture(62, 112, 84, seed=12), time_base=Fraction(10))
    llm = VideoLLM(tiny_checkpoint, engine_config=ENGINE_CONFIG)  # the default decode caps
    segments = list(llm.narrate(path, fps=0.1, max_tokens_per_segment=1))
    assert [s.t for s in segments] == [(20.0 * k, 20.0 * k + 10) for k in range(31)]
    assert any(s.rolled_over for s in segments)
