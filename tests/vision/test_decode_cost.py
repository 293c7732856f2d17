"""What a clip costs is known before a frame is decoded: `probe_video` plans exactly the frames
`decode_video` samples, at the size it returns them, and stops scanning a stream without a
declared duration as soon as the plan passes a budget. Decoding holds frames at the size the
model resizes them to, bit for bit what resizing the full frames gives."""

from fractions import Fraction

import numpy as np
import pytest
from PIL import Image

from stillcut.engine.models.frame_resize import FrameResize
from stillcut.engine.models.qwen2_vl.preprocess import smart_resize
from stillcut.vision.decode import DecodeConfig, decode_video, probe_video
from stillcut.vision.synthetic import gray_frames, moving_texture, write_video
from stillcut.vision.work import VisionWork

QWEN_RESIZE = FrameResize(lambda h, w: smart_resize(h, w), Image.Resampling.BICUBIC)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cost")
    vfr = folder / "vfr.mp4"
    pts = [0, 40, 90, 300, 310, 320, 900, 1000, 1500, 1990]
    write_video(vfr, gray_frames(range(10, 250, 24)), pts=pts, time_base=Fraction(1, 1000))
    raw = folder / "stream.h264"  # an elementary stream: no container, no declared duration
    write_video(raw, gray_frames([60] * 100, 32, 32), container_format="h264")
    wide = folder / "wide.mp4"  # sampled frames resize to fewer pixels than they display at
    write_video(wide, moving_texture(4, 1280, 720, seed=2), time_base=Fraction(1, 2))
    sar = folder / "sar.mp4"  # non-square pixels: displays at 96x48
    write_video(sar, gray_frames([90] * 4), sample_aspect_ratio=Fraction(3, 2))
    return {"vfr": vfr, "raw": raw, "wide": wide, "sar": sar}


@pytest.mark.parametrize(
    ("name", "config", "start", "end"),
    [
        ("vfr", DecodeConfig(fps=10), None, None),
        ("vfr", DecodeConfig(fps=4, max_frames=3), None, None),
        ("vfr", DecodeConfig(fps=2), 0.35, 1.2),
        ("raw", DecodeConfig(fps=3), None, None),
        ("wide", DecodeConfig(), None, None),
        ("sar", DecodeConfig(fps=30), None, None),
    ],
)
def test_the_probe_plans_what_decoding_samples(clips, name, config, start, end):
    probe = probe_video(clips[name], config, start=start, end=end)
    video = decode_video(clips[name], config, start=start, end=end)
    assert probe.complete and probe.num_samples == len(video.timestamps)
    assert (probe.width, probe.height) == (video.width, video.height)
    assert probe.duration == pytest.approx(video.duration)


def test_a_stream_without_duration_is_scanned_only_until_the_plan_passes_the_budget(clips):
    whole = probe_video(clips["raw"], DecodeConfig(fps=2))
    assert whole.complete and whole.num_samples == 7  # 100 frames at 30 fps: 3.33 s
    stopped = probe_video(clips["raw"], DecodeConfig(fps=2), max_samples=lambda width, height: 3)
    assert not stopped.complete and 3 < stopped.num_samples < whole.num_samples
    assert stopped.duration < 2.1  # the scan ended right after 1.5 s + one frame
    affordable = probe_video(clips["raw"], DecodeConfig(fps=2), max_samples=lambda width, height: 7)
    assert affordable == whole  # a budget the clip fits changes nothing


def test_frames_are_held_at_the_resized_size_bit_for_bit(clips):
    work = VisionWork()
    full = decode_video(clips["wide"])
    resized = decode_video(clips["wide"], resize=QWEN_RESIZE, work=work)
    target = smart_resize(720, 1280)
    assert resized.frames.shape == (len(full.frames), *target, 3)
    assert target[0] * target[1] < 720 * 1280
    assert (resized.width, resized.height) == (full.width, full.height) == (1280, 720)
    for small, frame in zip(resized.frames, full.frames, strict=True):
        np.testing.assert_array_equal(small, QWEN_RESIZE.apply(frame, target))
    assert work.frames_decoded == 4


def test_frames_smaller_than_the_target_stay_at_display_size(clips):
    video = decode_video(clips["sar"], resize=QWEN_RESIZE)
    assert video.frames.shape[1:] == (48, 96, 3)  # upscaling waits for preprocessing
