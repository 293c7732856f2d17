"""Dense and sparse sampling give the frames a plain decode gives: every frame decoded front to
back by PyAV, each sample time taking the last frame at or before it. Files with B-frames,
a variable frame rate and an edit list (frames before the start that the player drops)."""

import dataclasses
from fractions import Fraction

import av
import numpy as np
import pytest

import stillcut.vision.decode as decode_module
import stillcut.vision.frame_pass as frame_pass
from stillcut.vision.decode import DecodeConfig, decode_video, open_video, probe_video
from stillcut.vision.sampling import plan_samples
from stillcut.vision.synthetic import moving_texture, near_lossless_h264, write_video

NUM_FRAMES = 150
RATE = 10


def _texture(num_frames=NUM_FRAMES):
    return list(moving_texture(num_frames, 64, 48, seed=3))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """name -> path: B-frames with a keyframe every 8 frames; the same with a variable frame
    rate; and with an edit list (pts from -6: the first six frames are never shown)."""
    folder = tmp_path_factory.mktemp("seek")
    frames = _texture()
    options = {**near_lossless_h264(), "g": "8", "keyint_min": "8", "sc_threshold": "0"}
    vfr_pts = np.cumsum([0] + [1 + (i % 3) for i in range(NUM_FRAMES - 1)]).tolist()
    specs = {
        "b_frames": {},
        "vfr": {"pts": vfr_pts, "time_base": Fraction(1, 2 * RATE)},
        "edit_list": {"pts": [i - 6 for i in range(NUM_FRAMES)]},
    }
    paths = {}
    for name, spec in specs.items():
        paths[name] = folder / f"{name}.mp4"
        spec.setdefault("time_base", Fraction(1, RATE))
        write_video(paths[name], frames, options=options, **spec)
    return paths


def _plain_decode(path, times):
    """The reference: decode everything, pick the last shown frame at or before each time."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        origin = stream.start_time or 0
        shown = [
            (float((frame.pts - origin) * stream.time_base), frame.to_ndarray(format="rgb24"))
            for frame in container.decode(stream)
        ]
    picked = []
    for time in times:
        earlier = [rgb for shown_time, rgb in shown if shown_time <= time + 1e-6]
        picked.append(earlier[-1] if earlier else shown[0][1])
    return np.stack(picked)


@pytest.mark.parametrize("name", ["b_frames", "vfr", "edit_list"])
@pytest.mark.parametrize(
    ("fps", "start", "end"), [(5.0, None, None), (0.2, None, None), (0.2, 1.3, 13.7)]
)
def test_dense_and_sparse_sampling_equal_a_plain_decode(clips, name, fps, start, end):
    config = DecodeConfig(fps=fps, max_frames=100)
    video = decode_video(clips[name], config, start=start, end=end)
    plan = plan_samples(start or 0.0, video.duration, fps, 100)
    np.testing.assert_array_equal(video.frames, _plain_decode(clips[name], plan.times))


def test_sparse_sampling_seeks_instead_of_decoding_everything(clips):
    config = DecodeConfig(fps=0.2)  # a sample every 5 s, keyframes every 0.8 s
    probe = probe_video(clips["b_frames"], config)
    assert probe.num_seeks == probe.num_samples - 1
    with open_video(clips["b_frames"], config) as reader:
        work = decode_module.VisionWork()
        num_samples = sum(sampled.num_samples for sampled in reader.frames(work=work))
    assert num_samples == 3
    assert work.frames_decoded < NUM_FRAMES // 3  # about a GOP per sample, not the whole clip


def test_dense_sampling_never_seeks(clips):
    assert probe_video(clips["b_frames"], DecodeConfig(fps=5)).num_seeks == 0


def test_a_seek_that_lands_off_its_keyframe_goes_on_plainly(clips, monkeypatch):
    """Aiming at a frame that is no keyframe lands on the keyframe before it: the pass sees
    it and the plain pass takes over from the first sample not yet handed out."""
    plan_skips = frame_pass.plan_skips

    def misaimed(stream, scan, sample_times):
        planned = plan_skips(stream, scan, sample_times)
        jumps = list(planned.jumps)
        jumps[-1] = dataclasses.replace(jumps[-1], keyframe_pts=scan.pts[jumps[-1].to + 1])
        return dataclasses.replace(planned, jumps=tuple(jumps))

    config = DecodeConfig(fps=0.2)
    expected = decode_video(clips["b_frames"], config)
    monkeypatch.setattr(decode_module, "plan_skips", misaimed)
    passes = []
    iter_pass = frame_pass.iter_pass

    def logged(*args, **kwargs):
        passes.append(kwargs.get("num_done", 0))
        yield from iter_pass(*args, **kwargs)

    monkeypatch.setattr(decode_module, "iter_pass", logged)
    video = decode_video(clips["b_frames"], config)
    np.testing.assert_array_equal(video.frames, expected.frames)
    assert video.timestamps == expected.timestamps
    assert passes == [0, 2]  # two samples came from the seeking pass
