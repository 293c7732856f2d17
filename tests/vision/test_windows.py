"""A video longer than one window goes through the tower a window at a time and gives the item
the whole clip gives; when its dense embeddings are not held (they would not fit the encoder
cache), EVS prunes window by window and keeps exactly the same tokens."""

from fractions import Fraction

import pytest
import torch

from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import VisionPipeline
from stillcut.vision.synthetic import moving_texture, write_video

NUM_FRAMES = 46  # 23 tubelets: windows of 4 frames leave a short last one


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("windows") / "clip.mp4"
    write_video(path, moving_texture(NUM_FRAMES, 96, 64, seed=5), time_base=Fraction(1, 10))
    return path


@pytest.fixture(scope="module")
def pipelines(tiny_checkpoint):
    """One clip-sized window; windows of 4 frames holding dense embeddings; the same holding
    only what EVS keeps."""
    return {
        "whole": VisionPipeline(tiny_checkpoint, window_frames=64),
        "windows": VisionPipeline(tiny_checkpoint, window_frames=4),
        "pruned": VisionPipeline(tiny_checkpoint, window_frames=4, cache_bytes=0),
    }


def _frames_per_pass(pipeline, monkeypatch):
    passes = []
    encode = pipeline.tower.encode

    def counted(patches_list, grids, *kept):
        passes.append(grids[0][0])
        return encode(patches_list, grids, *kept)

    monkeypatch.setattr(pipeline.tower, "encode", counted)
    return passes


@pytest.mark.parametrize(
    "evs",
    [None, EVSConfig(mode="rate", rate=0.75), EVSConfig(mode="threshold", threshold=0.05)],
    ids=["off", "rate", "threshold"],
)
def test_windows_give_the_whole_clips_item(pipelines, clip, evs, monkeypatch):
    items = {}
    for name, pipeline in pipelines.items():
        passes = _frames_per_pass(pipeline, monkeypatch)
        pipeline.cache.clear()
        items[name] = pipeline.video(clip, evs=evs, fps=10.0, max_frames=NUM_FRAMES)
        assert passes == ([23] if name == "whole" else [2] * 11 + [1])  # tubelets per pass
        monkeypatch.undo()
    whole = items["whole"]
    assert len(whole.timestamps) == NUM_FRAMES
    for name in ("windows", "pruned"):
        item = items[name]
        assert item.timestamps == whole.timestamps
        assert item.grid_thw == whole.grid_thw
        assert item.kept_per_tubelet == whole.kept_per_tubelet
        assert torch.equal(item.coords, whole.coords)
        torch.testing.assert_close(item.embeds, whole.embeds, rtol=1e-5, atol=1e-5)
        assert item.identifier == whole.identifier
    assert pipelines["windows"].cache.nbytes > 0 and pipelines["pruned"].cache.nbytes == 0


def test_frames_held_at_the_target_give_the_full_size_result(tmp_path):
    """The demo model's smart resize of 640x360 lands under its min_pixels, so resizing its
    own output again would change it: decoding holds frames at the target and tells
    preprocessing the source size, and the item equals preprocessing the full-size frames."""
    from stillcut.demo import demo_checkpoint
    from stillcut.engine.models.qwen2_vl.preprocess import preprocess_video
    from stillcut.vision.decode import DecodeConfig, decode_video

    path = tmp_path / "wide.mp4"
    write_video(path, moving_texture(12, 640, 360, seed=4), time_base=Fraction(1, 4))
    pipeline = VisionPipeline(demo_checkpoint(), window_frames=4)
    held = decode_video(path, DecodeConfig(), resize=pipeline.media.frame_resize)
    assert held.frames.shape[1:3] == (140, 252)
    full = decode_video(path, DecodeConfig())
    prepared = preprocess_video(full.frames, full.sample_fps, pipeline.video_preprocess)
    with torch.inference_mode():
        (expected,) = pipeline.tower.encode([prepared.patches], [prepared.grid_thw])
    item = pipeline.video(path, evs=None)
    torch.testing.assert_close(item.embeds, expected, rtol=1e-5, atol=1e-5)
    assert item.grid_thw == prepared.grid_thw
