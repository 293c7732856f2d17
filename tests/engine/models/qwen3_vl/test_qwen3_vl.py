"""Qwen3-VL against transformers: the tower (with its DeepStack features) and greedy answers.

Tiny random `qwen3_vl` and `qwen3_vl_moe` checkpoints built with transformers' own classes.
The reference runs transformers' `Qwen3VLForConditionalGeneration` (and its MoE twin):
`get_video_features` for the tower and `generate` for the answers (tokens and the first one's
logits), fed pixels built as transformers' video processor builds them (`qwen3_reference`)
and the engine's prompt ids with their modality types. The prompt's per-tubelet timestamps
are checked as text.
"""

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import build_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.vision.pipeline import VisionPipeline

from .qwen3_reference import engine_answer, hand_pixels, random_frames

BLOCK = 16
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
FPS = 2.0


def _config(max_num_batched_tokens: int = 512, prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048
        ),
        cache=CacheConfig(num_blocks=256, block_size=BLOCK, enable_prefix_caching=prefix_caching),
    )


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def checkpoint(request, tmp_path_factory):
    """A tiny checkpoint of the dense family, then of the MoE one (experts in two of its three
    layers)."""
    folder = tmp_path_factory.mktemp(request.param) / "checkpoint"
    return build_checkpoint(folder, seed=1, family=request.param)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    model.generation_config.eos_token_id = None  # the engine ignores EOS: so does the reference
    return model


@pytest.fixture(scope="module")
def engine(checkpoint):
    return LLMEngine(checkpoint, _config())


@pytest.fixture(scope="module")
def pipeline(checkpoint):
    return VisionPipeline(checkpoint)


def _reference_answer(reference, prompt, engine, **media) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `prompt` and the logits of the first one."""
    ids = torch.tensor([prompt.token_ids])
    special = engine.processor.special
    types = (ids == special.image_token_id).int() + 2 * (ids == special.video_token_id).int()
    with torch.inference_mode():
        out = reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=types,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **media,
        )
    return out.sequences[0, ids.shape[1] :].tolist(), out.logits[0][0]


def _assert_same(answer, expected) -> None:
    """The engine's (output, first logits) equal the reference's (tokens, first logits)."""
    output, logits = answer
    assert output.token_ids == expected[0]
    torch.testing.assert_close(logits, expected[1], atol=1e-4, rtol=1e-4)


def _video_media(frames):
    patches, grid = hand_pixels(frames)
    return {"pixel_values_videos": patches, "video_grid_thw": torch.tensor([grid])}


def test_the_tower_and_its_deepstack_features_equal_transformers(reference, pipeline):
    frames = random_frames(5, 128, 160, seed=0)
    item = pipeline.video(frames, frames_fps=FPS)
    patches, grid = hand_pixels(frames)
    assert item.grid_thw == grid
    with torch.inference_mode():
        expected = reference.model.get_video_features(
            pixel_values_videos=patches, video_grid_thw=torch.tensor([grid])
        )
    torch.testing.assert_close(item.embeds, expected.pooler_output[0], atol=1e-5, rtol=1e-5)
    assert sorted(item.features) == ["deepstack.0", "deepstack.1"]
    for k, sets in enumerate(expected.deepstack_features):
        torch.testing.assert_close(item.features[f"deepstack.{k}"], sets[0], atol=1e-5, rtol=1e-5)


def test_a_video_is_written_one_timestamped_tubelet_at_a_time(engine, pipeline):
    item = pipeline.video(random_frames(5, 128, 160, seed=0), frames_fps=FPS)
    prompt = engine.processor.build_text("What happens?", [item])
    text = engine.processor.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    tokens = 4 * 5  # 128 x 160 px: 4 x 5 merged tokens a tubelet
    block = "<|vision_start|>" + "<|video_pad|>" * tokens + "<|vision_end|>"
    # frames at 0, 0.5, ..., 2 s; the fifth frame stands in for the missing sixth
    tubelets = "".join(f"<{t:.1f} seconds>{block}" for t in (0.25, 1.25, 2.0))
    assert f"<|vision_start|>{tubelets}<|vision_end|>" in text
    assert [p.length for p in prompt.mm_positions] == [tokens] * 3


def test_a_video_answer_equals_transformers_generate(engine, pipeline, reference):
    frames = random_frames(5, 128, 160, seed=0)
    prompt = engine.processor.build_text("What happens?", [pipeline.video(frames, frames_fps=FPS)])
    expected = _reference_answer(reference, prompt, engine, **_video_media(frames))
    _assert_same(engine_answer(engine, prompt), expected)


def test_an_image_answer_equals_transformers_generate(engine, pipeline, reference):
    image = random_frames(1, 96, 128, seed=2)
    prompt = engine.processor.build_text("Describe it.", [pipeline.image(image[0])])
    patches, grid = hand_pixels(image)  # one frame repeated to a tubelet, as for images
    media = {"pixel_values": patches, "image_grid_thw": torch.tensor([grid])}
    _assert_same(
        engine_answer(engine, prompt), _reference_answer(reference, prompt, engine, **media)
    )


def test_chunks_that_split_a_tubelet_and_a_prefix_hit_leave_the_answer_unchanged(
    checkpoint, engine, pipeline, reference
):
    frames = random_frames(6, 128, 160, seed=3)
    item = pipeline.video(frames, frames_fps=FPS)

    def ask(question):
        parts = [{"type": "text", "text": "Watch:"}, {"type": "video"}]
        parts.append({"type": "text", "text": question})
        return engine.processor.build([{"role": "user", "content": parts}], [item])

    media = _video_media(frames)
    chunked = LLMEngine(checkpoint, _config(max_num_batched_tokens=7, prefix_caching=False))
    prompt = ask("What happens?")
    _assert_same(
        engine_answer(chunked, prompt), _reference_answer(reference, prompt, engine, **media)
    )

    engine.generate([prompt], GREEDY)
    second = ask("Which colours?")
    answer = engine_answer(engine, second)
    assert answer[0].metrics.num_cached_tokens > second.mm_positions[0].offset  # hit in the video
    _assert_same(answer, _reference_answer(reference, second, engine, **media))


def test_two_videos_in_one_prompt_equal_transformers_generate(engine, pipeline, reference):
    first, second = random_frames(4, 128, 160, seed=6), random_frames(3, 96, 128, seed=7)
    items = [pipeline.video(frames, frames_fps=FPS) for frames in (first, second)]
    parts = [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "video"}]
    parts.append({"type": "text", "text": "What changed?"})
    prompt = engine.processor.build([{"role": "user", "content": parts}], items)
    assert len(prompt.items) == 2 + 2  # each video's tubelets
    (patches, grid), (more, other) = hand_pixels(first), hand_pixels(second)
    media = {
        "pixel_values_videos": torch.cat([patches, more]),
        "video_grid_thw": torch.tensor([grid, other]),
    }
    _assert_same(
        engine_answer(engine, prompt), _reference_answer(reference, prompt, engine, **media)
    )
