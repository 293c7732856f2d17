"""Qwen3.5 against transformers: the tower and greedy answers (video, image, text), prompts split
into prefill chunks across the video, and the stored parts it skips.

Tiny random `qwen3_5` and `qwen3_5_moe` checkpoints built with transformers' own classes
(three Gated DeltaNet layers, then a full-attention layer; the MoE one with a shared expert in
every layer). Qwen3.5's tokenizer is not available offline: the checkpoints carry the Qwen2.5
tokenizer, and their configs' media token ids are remapped to its ids (the recipe's
docstring), which transformers reads like any others. The reference runs transformers'
`Qwen3_5ForConditionalGeneration` (and its MoE twin): `get_video_features` for the tower and
`generate` for the answers (tokens and the first one's logits), fed pixels built as its video
processor builds them and the engine's prompt ids with their modality types (the Qwen3-VL
tests' helpers, which serve both families).
"""

import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.models.qwen3_5.config import text_config
from stillcut.vision.pipeline import VisionPipeline

from ..qwen3_vl.qwen3_reference import engine_answer, hand_pixels, random_frames
from ..qwen3_vl.test_qwen3_vl import _assert_same as assert_same
from ..qwen3_vl.test_qwen3_vl import _config as engine_config
from ..qwen3_vl.test_qwen3_vl import _reference_answer as reference_answer
from ..qwen3_vl.test_qwen3_vl import _video_media as video_media

FPS = 2.0
MAX_TOKENS = 8  # the Qwen3-VL helpers' answers
FAMILIES = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request):
    return cached_checkpoint("tiny", seed=1, family=request.param)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    model.generation_config.eos_token_id = None  # the engine ignores EOS: so does the reference
    return model


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine(checkpoint, engine_config())


@pytest.fixture(scope="module")
def pipeline(checkpoint):
    return VisionPipeline(checkpoint)


def test_the_tower_equals_transformers_and_gives_no_deepstack_features(reference, pipeline):
    frames = random_frames(5, 128, 160, seed=0)
    item = pipeline.video(frames, frames_fps=FPS)
    patches, grid = hand_pixels(frames)
    assert item.grid_thw == grid
    with torch.inference_mode():
        expected = reference.model.get_video_features(
            pixel_values_videos=patches, video_grid_thw=torch.tensor([grid])
        )
    torch.testing.assert_close(item.embeds, expected.pooler_output[0], atol=1e-5, rtol=1e-5)
    assert item.features == {}


def test_a_video_answer_equals_transformers_generate(engine, pipeline, reference):
    frames = random_frames(5, 128, 160, seed=0)
    prompt = engine.processor.build_text("What happens?", [pipeline.video(frames, frames_fps=FPS)])
    expected = reference_answer(reference, prompt, engine, **video_media(frames))
    assert len(set(expected[0])) > 1  # the answer says something: not one token repeated
    assert_same(engine_answer(engine, prompt), expected)


def test_an_image_answer_equals_transformers_generate(engine, pipeline, reference):
    image = random_frames(1, 96, 128, seed=2)
    prompt = engine.processor.build_text("Describe it.", [pipeline.image(image[0])])
    patches, grid = hand_pixels(image)  # one frame repeated to a tubelet, as for images
    media = {"pixel_values": patches, "image_grid_thw": torch.tensor([grid])}
    assert_same(engine_answer(engine, prompt), reference_answer(reference, prompt, engine, **media))


def test_a_text_answer_equals_transformers_generate(engine, reference, native_steps):
    prompt = engine.processor.build([{"role": "user", "content": "Tell me about lighthouses."}])
    assert_same(engine_answer(engine, prompt), reference_answer(reference, prompt, engine))
    # both decode in the native step (the DeltaNet, gated attention, SwiGLU and MoE kinds)
    if os.environ.get("STILLCUT_REQUIRE_NATIVE_DECODE"):
        assert native_steps == [1] * (MAX_TOKENS - 1), "a decode step ran the torch layers"


@pytest.mark.parametrize("chunk", [16, 50, 64])
def test_prefill_chunks_splitting_the_video_leave_the_answer_unchanged(
    checkpoint, pipeline, reference, chunk
):
    frames = random_frames(8, 128, 160, seed=3)
    chunked = LLMEngine(checkpoint, engine_config(chunk, prefix_caching=False))
    item = pipeline.video(frames, frames_fps=FPS)
    parts = [{"type": "text", "text": "Watch this:"}, {"type": "video"}]
    parts.append({"type": "text", "text": "What happens?"})
    prompt = chunked.processor.build([{"role": "user", "content": parts}], [item])
    ends = range(chunk, len(prompt.token_ids), chunk)  # where the chunks end
    assert any(p.offset < end < p.end for p in prompt.mm_positions for end in ends)
    expected = reference_answer(reference, prompt, chunked, **video_media(frames))
    assert_same(engine_answer(chunked, prompt), expected)


def test_stored_mtp_layers_are_skipped_with_a_log_line(checkpoint, tmp_path, caplog):
    path = tmp_path / "with-mtp"
    shutil.copytree(checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.ones(32, 64)  # as released: beside `model.*`
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.ones(32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="stillcut.engine.loader"):
        engine = LLMEngine(path, engine_config())
    assert "skipping 2 unused tensors" in caplog.text and "mtp.fc.weight" in caplog.text
    prompt = engine.processor.build([{"role": "user", "content": "Hello."}])
    base = LLMEngine(checkpoint, engine_config())
    assert engine_answer(engine, prompt)[0].token_ids == engine_answer(base, prompt)[0].token_ids


def test_the_config_reader_names_what_it_cannot_serve(checkpoint, tmp_path):
    import json

    raw = json.loads((checkpoint / "config.json").read_text())
    config = text_config(load_model_config(checkpoint))
    assert config.layer_kinds == ("linear_attention",) * 3 + ("full_attention",)
    assert config.rotary_dim == config.head_dim // 4
    cases = [
        ({"layer_types": ["linear_attention", "sliding"]}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 4}, "needs at least one full_attention"),
        ({"linear_num_key_heads": 3}, "must divide linear_num_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]
    for change, message in cases:
        broken = tmp_path / f"broken-{len(message)}"
        broken.mkdir()
        (broken / "config.json").write_text(
            json.dumps({**raw, "text_config": {**raw["text_config"], **change}})
        )
        with pytest.raises(CheckpointError, match=message):
            text_config(load_model_config(broken))
