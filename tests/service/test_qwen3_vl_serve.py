"""Qwen3-VL and Qwen3.5 (which shares its tower and prompt), dense and MoE, behind the server:
the official `openai` client with a `video_url`, plain and streamed, gets transformers'
greedy answer (EVS off). The reference is
fed the frames the server sampled (decoded here with the same settings) as transformers' video
processor builds pixels from them: the clip is 224 x 224, a multiple of 32, so no resize comes
between."""

import shutil

import openai
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.service.api import VideoLLM
from stillcut.service.config import ServerConfig
from stillcut.service.server import BackgroundServer
from stillcut.vision.decode import DecodeConfig, decode_video

from ..engine.models.qwen3_vl.qwen3_reference import hand_pixels

MAX_TOKENS = 10
DECODE = DecodeConfig(fps=2.0, max_frames=5)
QUESTION = "What happens in this video?"


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def served(request, samples_dir, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    checkpoint = cached_checkpoint("tiny", seed=1, family=request.param)
    media_dir = tmp_path_factory.mktemp("qwen3-media")
    shutil.copy(samples_dir / "motion_mask.mp4", media_dir / "clip.mp4")
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048),
        cache=CacheConfig(num_blocks=128, block_size=16),
    )
    llm = VideoLLM(checkpoint, engine_config=engine_config, decode_config=DECODE)
    background = BackgroundServer(llm, ServerConfig(media_dir=media_dir))
    client = openai.OpenAI(api_key="unused", base_url=f"{background.url}/v1", max_retries=0)
    reference = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    reference.generation_config.eos_token_id = None
    try:
        yield llm, client, media_dir / "clip.mp4", reference
    finally:
        background.stop()


def _reference_text(served) -> str:
    """transformers' greedy answer to the clip's sampled frames and the question, as text up
    to the first end-of-turn token."""
    llm, _, clip, reference = served
    decoded = decode_video(clip, DECODE)
    assert decoded.frames.shape[1:3] == (224, 224)
    times = tuple(decoded.timestamps)
    item = llm.pipeline.video(decoded.frames, frames_fps=decoded.sample_fps, timestamps=times)
    processor = llm.processor
    parts = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    prompt = processor.build([{"role": "user", "content": parts}], [item])
    ids = torch.tensor([prompt.token_ids])
    patches, grid = hand_pixels(decoded.frames)
    with torch.inference_mode():
        out = reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=2 * (ids == processor.special.video_token_id).int(),
            pixel_values_videos=patches,
            video_grid_thw=torch.tensor([grid]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    tokens = out[0, ids.shape[1] :].tolist()
    eos = set(processor.special.eos_token_ids)
    ended = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return processor.tokenizer.decode(tokens[:ended], skip_special_tokens=True)


def _request(clip, **options):
    parts = [{"type": "video_url", "video_url": {"url": f"file://{clip}"}}]
    parts.append({"type": "text", "text": QUESTION})
    return {
        "model": None,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "extra_body": {"evs": "off"},
        **options,
    }


def test_a_video_url_answer_equals_transformers_plain_and_streamed(served):
    _, client, clip, _ = served
    expected = _reference_text(served)
    assert expected  # some text: an empty answer would match anything empty
    answer = client.chat.completions.create(**_request(clip))
    assert answer.choices[0].message.content == expected
    stream = client.chat.completions.create(**_request(clip, stream=True))
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert text == expected
