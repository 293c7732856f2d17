"""The shipped demo checkpoint: small bf16 safetensors, and our engine answers as transformers does.

The demo is trained (never at first use) and ships with the package. Parity is checked on
held-out task clips, every question type in one batch: with EVS off against transformers'
`generate` (given the token types its processor returns, `reference.qwen_hf_inputs`: without
them it places the video as text, with 1-D positions), and with describe's default EVS (rate 0.75)
against a greedy loop over transformers' forward fed our pruned embeddings and positions
(`generate` would recompute positions for an unpruned video). On these clips no greedy step
is a near-tie: transformers' top two logits are at least 0.02 apart at every step.
"""

import json
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open

from stillcut.demo import architecture, demo_checkpoint
from stillcut.demo.clips import clip_bytes, held_out_seeds
from stillcut.demo.questions import PROMPTS, QUESTION_TYPES
from stillcut.demo.scenes import sample_scene
from stillcut.demo.train import TASK_VERSION, TrainConfig
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.pipeline import VideoInput, VisionPipeline

from ..engine.reference import hf_greedy, qwen_hf_inputs

MAX_TOKENS = 40
CLIP_SEEDS = list(held_out_seeds())[:3]


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForImageTextToText

    folder = demo_checkpoint()
    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return LLMEngine(folder), VisionPipeline(folder), reference


def test_shipped_checkpoint_is_small_bf16_safetensors():
    folder = demo_checkpoint()
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    with safe_open(weights, "pt") as tensors:
        assert {tensors.get_slice(name).get_dtype() for name in tensors.keys()} == {"BF16"}
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and "stillcut_demo" in config
    for name in ("tokenizer.json", "chat_template.jinja", "video_preprocessor_config.json"):
        assert (folder / name).is_file(), name


def test_trainer_defaults_are_the_shipped_recipe():
    config = json.loads((demo_checkpoint() / "config.json").read_text())
    assert config["stillcut_demo"] == {
        "task_version": TASK_VERSION,
        "recipe": asdict(TrainConfig()),
    }


def test_every_rotary_axis_has_fast_and_slow_frequencies():
    """The shipped M-RoPE is the architecture's, and as transformers computes it each of t, h
    and w has a frequency of at least half a radian per position and one slow enough to stay
    nearly still across a prompt (plain Qwen2.5-VL at this size gives w none above 0.004)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = demo_checkpoint()
    text = json.loads((folder / "config.json").read_text())["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert text["rope_parameters"] == architecture.rope_parameters(head_dim)
    config = AutoConfig.from_pretrained(folder).text_config
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](config)
    assert scaling == 1.0
    axes = torch.arange(3).repeat_interleave(torch.tensor(text["rope_parameters"]["mrope_section"]))
    for axis in range(3):
        frequencies = inv_freq[axes == axis]
        assert frequencies.max() >= 0.5 and frequencies.min() <= 0.02, (axis, frequencies)


def _ask_everything(engine, pipeline, evs):
    """Every question type about every clip, as (prompt, item, clip bytes) triples."""
    asked = []
    for seed in CLIP_SEEDS:
        data = clip_bytes(sample_scene(seed))
        item = pipeline.video(data, evs=evs)
        for kind in QUESTION_TYPES:
            asked.append((engine.processor.build_text(PROMPTS[kind][0], [item]), item, data))
    return asked


def _answer_ids(token_ids: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    """The answer up to (not including) its first end token."""
    ends = [i for i, t in enumerate(token_ids) if t in eos_ids]
    return token_ids[: ends[0]] if ends else token_ids


def test_greedy_answers_equal_transformers_generate(demo):
    engine, pipeline, reference = demo
    asked = _ask_everything(engine, pipeline, evs=None)
    outputs = engine.generate([p for p, _, _ in asked], SamplingParams(max_tokens=MAX_TOKENS))
    eos = engine.processor.special.eos_token_ids
    for (prompt, _, data), output in zip(asked, outputs, strict=True):
        decoded = decode_video(data, DecodeConfig())
        video = VideoInput(decoded.frames, frames_fps=decoded.sample_fps)
        inputs = qwen_hf_inputs(pipeline, prompt, [video], "qwen2_5_vl")
        theirs = hf_greedy(reference, inputs, MAX_TOKENS)
        assert _answer_ids(output.token_ids, eos) == _answer_ids(theirs, eos)
        assert output.finish_reason == "stop"  # every answer ends well before the cap


def test_greedy_answers_with_default_evs_equal_a_loop_over_transformers_forward(demo):
    from transformers import DynamicCache

    engine, pipeline, reference = demo
    asked = _ask_everything(engine, pipeline, evs=EVSConfig(mode="rate", rate=0.75))
    outputs = engine.generate([p for p, _, _ in asked], SamplingParams(max_tokens=MAX_TOKENS))
    eos = engine.processor.special.eos_token_ids
    embed = reference.get_input_embeddings()
    for (prompt, item, _), output in zip(asked, outputs, strict=True):
        assert item.num_tokens < item.num_dense_tokens
        token_ids = torch.tensor(prompt.token_ids)
        positions, next_position = engine.model.prompt_positions(token_ids, prompt.items)
        embeds = embed(token_ids[None])
        embeds[0, token_ids == engine.processor.special.video_token_id] = item.embeds
        cache, position_ids, theirs = DynamicCache(config=reference.config), positions[:, None], []
        with torch.inference_mode():
            for step in range(MAX_TOKENS):
                logits = reference(
                    inputs_embeds=embeds, position_ids=position_ids, cache=cache, use_cache=True
                ).logits
                theirs.append(int(logits[0, -1].argmax()))
                if theirs[-1] in eos:
                    break
                embeds = embed(torch.tensor([[theirs[-1]]]))
                position_ids = torch.full((3, 1, 1), next_position + step)
        assert _answer_ids(output.token_ids, eos) == _answer_ids(theirs, eos)
