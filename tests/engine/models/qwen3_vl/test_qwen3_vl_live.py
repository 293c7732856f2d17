"""Qwen3-VL's live-stream and narration prompts against transformers' `Qwen3VLProcessor`: a
stream's held prefix, tubelet by tubelet, writes each tubelet's `<t seconds>` block exactly as
the processor writes the whole clip's frames (t the mean of the tubelet's two frame times, an
odd last frame standing in for its missing twin), and a narration writes the same t. Qwen3.5,
which takes Qwen3-VL's prompt, writes them alike."""

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.processor import PromptProcessor
from stillcut.engine.prompt_formats import frame_items

FPS = 2.0
GRID_HW = (6, 8)  # patches: 3 x 4 merged tokens a tubelet
TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def processor(request):
    return PromptProcessor.from_checkpoint(cached_checkpoint("tiny", seed=1, family=request.param))


def _video(num_frames: int, kept: list[int] | None = None) -> MultiModalItem:
    """A video of `num_frames` frames at FPS from 0 s, its tubelets keeping `kept` tokens."""
    num_tubelets = -(-num_frames // 2)
    kept = kept or [TOKENS] * num_tubelets
    coords = torch.cat([torch.tensor([[t, 0, 0]]).expand(n, 3) for t, n in enumerate(kept)])
    return MultiModalItem(
        "video",
        torch.zeros(sum(kept), 4),
        coords,
        (num_tubelets, *GRID_HW),
        timestamps=tuple(k / FPS for k in range(num_frames)),
        identifier="clip",
    )


def _stream(video: MultiModalItem) -> list[MultiModalItem]:
    """The video as a live session holds it: one item per tubelet, each with its own frames."""
    return [
        replace(tubelet, identifier=f"live{k}") for k, tubelet in enumerate(frame_items(video, 2))
    ]


def _transformers_video_text(num_frames: int, num_tubelets: int) -> str:
    """What `Qwen3VLProcessor.replace_video_token` writes for `num_frames` frames sampled at
    FPS from a video's start (frame k is its frame k at FPS)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    writer = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        _calculate_timestamps=partial(Qwen3VLProcessor._calculate_timestamps, None),
    )
    inputs = {
        "video_grid_thw": torch.tensor([[num_tubelets, *GRID_HW]]),
        "video_metadata": [SimpleNamespace(fps=FPS, frames_indices=list(range(num_frames)))],
    }
    return Qwen3VLProcessor.replace_video_token(writer, inputs, 0)


@pytest.mark.parametrize("num_frames", [2, 5, 8])
def test_a_stream_prefix_is_the_processors_text_for_the_frames_so_far(processor, num_frames):
    video = _video(num_frames)
    prefix = processor.vision_prefix(_stream(video))
    question = processor.ask_suffix("What happens?")
    whole = processor.build_text("What happens?", [video])
    assert prefix.token_ids + question == whole.token_ids
    assert prefix.mm_positions == whole.mm_positions
    text = processor.tokenizer.decode(prefix.token_ids, skip_special_tokens=False)
    expected = _transformers_video_text(num_frames, len(prefix.items))
    assert text.endswith(f"<|vision_start|>{expected}")


def test_appending_tubelets_one_at_a_time_builds_the_same_prefix(processor):
    tubelets = _stream(_video(6))
    appended = processor.vision_prefix(tubelets[:1]).token_ids
    for tubelet in tubelets[1:]:
        new_input = processor.stream_input([tubelet])
        assert [tubelet] == new_input.items
        offset = new_input.mm_positions[0].offset
        assert (
            new_input.token_ids[offset : offset + TOKENS]
            == [processor.special.video_token_id] * TOKENS
        )
        appended += new_input.token_ids
    assert appended == processor.vision_prefix(tubelets).token_ids


def test_a_tubelet_evs_emptied_keeps_its_timestamp_and_markers(processor):
    video = _video(6, kept=[TOKENS, 0, 3])
    held = processor.vision_prefix(_stream(video))
    assert held.token_ids == processor.build_text("Q", [video]).token_ids[: len(held.token_ids)]
    empty = processor.stream_input(_stream(video)[1:2])
    text = processor.tokenizer.decode(empty.token_ids, skip_special_tokens=False)
    assert text == "<1.2 seconds><|vision_start|><|vision_end|>"  # frames at 1.0 and 1.5 s


def test_narration_writes_each_tubelets_time_as_the_processor_does(processor):
    tubelets = _stream(_video(7))  # the last tubelet is one frame, padded by its copy
    expected = _transformers_video_text(7, len(tubelets))
    written = ""
    for tubelet in tubelets:
        ids = processor.narration_input(tubelet, processor.tubelet_time(tubelet))
        written += processor.tokenizer.decode(ids, skip_special_tokens=False)
    assert written == expected
