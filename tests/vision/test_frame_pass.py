"""The decoding pass's shortcuts: skipping frames nobody samples, seeking to a late start, and
falling back to a plain pass when either misfires. Results must equal decoding everything."""

import dataclasses
from fractions import Fraction

import numpy as np
import pytest

import stillcut.vision.decode as decode_module
import stillcut.vision.frame_pass as frame_pass
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.synthetic import gray_frames, near_lossless_h264, write_video


@pytest.fixture(scope="module")
def b_frame_clip(tmp_path_factory):
    """40 frames at 10 fps with B-frames, a keyframe every 8; frame i has gray level 10 + 6 i."""
    path = tmp_path_factory.mktemp("clips") / "b_frames.mp4"
    levels = [10 + 6 * i for i in range(40)]
    write_video(path, gray_frames(levels), time_base=Fraction(1, 10),
                options={**near_lossless_h264(), "g": "8"})  # fmt: skip
    return path


def _frame_indices(video):
    means = video.frames.reshape(len(video.frames), -1).mean(axis=1)
    return [round((m - 10) / 6) for m in means]


@pytest.fixture
def pass_log(monkeypatch):
    """Records, per pass, the plan it ran with and how many frames the decoder produced."""
    log = []
    iter_pass, decoded_frames = frame_pass.iter_pass, frame_pass._decoded_frames

    def logged_iter_pass(container, stream, plan, config, **output):
        log.append({"plan": plan, "decoded": 0})
        yield from iter_pass(container, stream, plan, config, **output)

    def counted_decoded_frames(*args):
        for item in decoded_frames(*args):
            log[-1]["decoded"] += 1
            yield item

    monkeypatch.setattr(decode_module, "iter_pass", logged_iter_pass)
    monkeypatch.setattr(frame_pass, "_decoded_frames", counted_decoded_frames)
    return log


def test_frames_nobody_samples_are_not_decoded(b_frame_clip, pass_log):
    video = decode_video(b_frame_clip, DecodeConfig(fps=2))
    assert _frame_indices(video) == [0, 5, 10, 15, 20, 25, 30, 35]
    assert len(pass_log) == 1 and pass_log[0]["plan"].skip is not None
    # Decoding stops after 3.6 s (37 frames); the unsampled B-frames among them are skipped.
    assert pass_log[0]["decoded"] < 30


def test_skipping_gives_the_same_frames_as_decoding_everything(b_frame_clip, monkeypatch):
    config = DecodeConfig(fps=3)
    fast = decode_video(b_frame_clip, config, start=1.3)
    monkeypatch.setattr(decode_module, "plan_skips", lambda *args: None)
    plain = decode_video(b_frame_clip, config, start=1.3)
    np.testing.assert_array_equal(fast.frames, plain.frames)
    assert fast.timestamps == plain.timestamps


def test_a_wrong_skip_prediction_falls_back_to_a_plain_pass(b_frame_clip, monkeypatch, pass_log):
    def plan_nothing_wanted(stream, scan, sample_times):
        planned = frame_pass.plan_skips(stream, scan, sample_times)
        # every non-reference frame would be skipped
        return dataclasses.replace(planned, wanted_pts=frozenset())

    monkeypatch.setattr(decode_module, "plan_skips", plan_nothing_wanted)
    video = decode_video(b_frame_clip, DecodeConfig(fps=2))
    assert _frame_indices(video) == [0, 5, 10, 15, 20, 25, 30, 35]
    assert [entry["plan"].skip is None for entry in pass_log] == [False, True]


def test_a_seek_that_lands_after_start_falls_back_to_a_plain_pass(
    b_frame_clip, monkeypatch, pass_log
):
    seek = frame_pass._seek_to

    def seek_too_far(container, stream, clock, time):
        return seek(container, stream, clock, time + 2.0)  # an imprecise demuxer

    monkeypatch.setattr(decode_module, "plan_skips", lambda *args: None)  # no packet index
    monkeypatch.setattr(frame_pass, "_seek_to", seek_too_far)
    video = decode_video(b_frame_clip, DecodeConfig(fps=2), start=1.25, end=2.5)
    assert _frame_indices(video) == [12, 17, 22]  # times 1.25, 1.75, 2.25
    assert [entry["plan"].seek for entry in pass_log] == [True, False]
