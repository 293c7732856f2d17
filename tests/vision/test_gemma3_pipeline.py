"""The pipeline's Gemma 3 path: images and video frames through Gemma 3 preprocessing and the
SigLIP encoder, a video as a (frames, 4, 4) token grid, EVS across frames, bidirectional items.
"""

import numpy as np
import pytest
import torch

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.models.gemma3.preprocess import preprocess_frames
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.decode import decode_video
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline
from stillcut.vision.synthetic import moving_texture, write_video


@pytest.fixture(scope="module")
def pipeline():
    return VisionPipeline(cached_checkpoint("tiny", family="gemma3"))


def frames(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 40, 56, 3), dtype=np.uint8)


def test_video_and_image_items_are_the_encoder_output_of_each_frame(pipeline):
    clip, picture = frames(3), frames(1, seed=1)[0]
    video, image = pipeline.encode([VideoInput(clip, frames_fps=2.0), ImageInput(picture)])
    with torch.inference_mode():
        pixels = preprocess_frames(np.concatenate([clip, picture[None]]), pipeline.media.preprocess)
        expected = pipeline.tower.encode(pixels)  # [4, 16, hidden]
    assert (video.kind, video.grid_thw, video.llm_grid) == ("video", (3, 4, 4), (3, 4, 4))
    assert video.timestamps == (0.0, 0.5, 1.0) and video.kept_per_tubelet == (16, 16, 16)
    assert image.grid_thw == (1, 4, 4) and image.num_tokens == 16
    assert video.bidirectional and image.bidirectional
    torch.testing.assert_close(video.embeds, expected[:3].flatten(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(image.embeds, expected[3], rtol=0, atol=1e-5)
    # row-major (t, h, w) coordinates: frame f, token i at (f, i // 4, i % 4)
    assert video.coords[17].tolist() == [1, 0, 1]


def test_evs_runs_across_frames_on_cached_embeddings_and_keeps_the_first(pipeline):
    clip = frames(4, seed=2)
    clip[2] = clip[1]  # a repeated frame changes nothing: EVS drops it first
    dense = pipeline.video(clip, frames_fps=2.0)
    pruned = pipeline.video(clip, evs=EVSConfig(mode="rate", rate=0.5), frames_fps=2.0)
    assert pruned.stats["cache_hit"] and pruned.identifier != dense.identifier
    assert pruned.num_tokens == 32 and pruned.num_dense_tokens == 64
    assert pruned.kept_per_tubelet[0] == 16 and pruned.kept_per_tubelet[2] == 0
    kept_rows = (pruned.coords * torch.tensor([16, 4, 1])).sum(1)  # flat (t, h, w) index
    torch.testing.assert_close(pruned.embeds, dense.embeds[kept_rows], rtol=0, atol=0)


def test_a_video_file_is_the_encoder_output_of_its_full_size_frames(pipeline, tmp_path):
    """Decoding holds the frames at the encoder's square; the result is what preprocessing
    the display-size frames gives."""
    path = tmp_path / "clip.mp4"
    write_video(path, moving_texture(4, 96, 64, seed=4))
    item = pipeline.video(path)
    decoded = decode_video(path, pipeline.decode_config)
    assert pipeline.media.preprocess.image_size**2 < 96 * 64  # the resize shrinks frames
    pixels = preprocess_frames(decoded.frames, pipeline.media.preprocess)  # [4, 3, S, S]
    with torch.inference_mode():
        expected = pipeline.tower.encode(pixels)
    torch.testing.assert_close(item.embeds, expected.flatten(0, 1), rtol=0, atol=0)
    assert (item.stats["width"], item.stats["height"]) == (96, 64)
