"""Nemotron 3 Nano Omni's prompt format: a video is one labelled chunk per tubelet, with the
labels transformers' processor writes (frame times from source indices at `int(1000 / fps)`
ms a frame, a last tubelet of one frame, no times without a frame rate); each tubelet is
placed as its own item, one EVS pruned away entirely keeps its label and `<img></img>`."""

import re
import types

import pytest
import torch

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem, dense_coords
from stillcut.engine.processor import PromptProcessor

GRID = (3, 4, 6)  # 3 tubelets of 4 x 6 patches: 2 x 3 = 6 tokens each


@pytest.fixture(scope="module")
def processor():
    return PromptProcessor.from_checkpoint(
        cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    )


def _video(num_frames: int, fps: float | None, kept_rows: slice = slice(None)) -> MultiModalItem:
    coords = dense_coords(GRID[0], GRID[1] // 2, GRID[2] // 2)[kept_rows]  # [kept, 3]
    return MultiModalItem(
        kind="video",
        embeds=torch.zeros(coords.shape[0], 64),
        coords=coords,
        grid_thw=GRID,
        timestamps=tuple(k / 2 for k in range(num_frames)),
        source_indices=tuple(15 * k for k in range(num_frames)),
        source_fps=fps,
    )


def _transformers_text(item: MultiModalItem) -> str:
    """transformers' processor's text for the video (its `replace_video_token`)."""
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3Processor as Processor,
    )
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(
        total_num_frames=len(item.timestamps),
        fps=item.source_fps,
        frames_indices=list(item.source_indices),
    )
    inputs = {
        "num_frames": [len(item.timestamps)],
        "video_metadata": [metadata],
        "pixel_values_videos": torch.zeros(1, GRID[0], 6, GRID[1] * 16, GRID[2] * 16),
    }
    writer = types.SimpleNamespace(
        image_start_token="<img>",
        image_token="<image>",
        image_end_token="</img>",
        video_processor=types.SimpleNamespace(patch_size=16, downsample_ratio=0.5),
        video_temporal_patch_dim=2,
    )
    return Processor.replace_video_token(writer, inputs, 0)


@pytest.mark.parametrize(("num_frames", "fps"), [(5, 30.0), (6, 24.0), (6, None)])
def test_video_chunks_are_labelled_as_transformers_labels_them(processor, num_frames, fps):
    video = _video(num_frames, fps)
    rendered = processor.chat_template.render(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}]
    )
    text, placed = processor.family.prompt_format.expand(rendered, [video], processor._markers)
    chunks = re.sub("(<image>)+", "<image>", _transformers_text(video))  # one placeholder each
    expected = rendered.replace("<video>", chunks)
    assert text == expected
    assert [item.num_tokens for item in placed] == [6, 6, 6]
    if fps == 30.0:  # 15 frames at int(1000 / 30) = 33 ms: 0.495 s
        assert "frame 2 sampled at 0.49 seconds" in text and "Frame 5 sampled" in text


def test_a_tubelet_pruned_away_keeps_its_label_and_markers(processor):
    video = _video(6, 24.0, kept_rows=slice(0, 9))  # the first tubelet, half of the second
    prompt = processor.build(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}],
        [video],
    )
    assert [p.length for p in prompt.mm_positions] == [6, 3, 0]
    text = processor.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    # source frames 60 and 75 at int(1000 / 24) = 41 ms a frame
    last = "Frame 5 sampled at 2.46 seconds and frame 6 sampled at 3.08 seconds: <img></img>"
    assert last in text
    assert sum(t == processor.special.image_token_id for t in prompt.token_ids) == 9


def test_media_out_of_order_with_their_markers_is_an_error(processor):
    rendered = "<|im_start|>user\n<image>\n<|im_end|>\n"
    with pytest.raises(CheckpointError, match="rendered a image marker where the media parts"):
        processor.family.prompt_format.expand(rendered, [_video(2, 2.0)], processor._markers)
