"""A narration (EVS off) equals transformers run once over the sequence it produced.

A streaming request narrates 8 tubelets: the instruction, then per tubelet its timestamp text
and the tubelet as its own video, then a segment the model generates until a segment-end token
(any token holding a newline), `max_tokens` or EOS (not kept). Transformers' own model is then
fed the whole sequence (prompt, every tubelet's pixels, every segment) in one forward with its
own positions (`get_rope_index`): at every generated position its argmax is our token, and
each segment ends where the rules say. For Qwen2.5-VL and for Qwen3-VL, whose narration writes
each tubelet as its processor does (`<t seconds>`, t the mean of the tubelet's frame times), and
whose DeepStack features reach the first layers at each tubelet's tokens; and for Qwen3.5 and
Qwen3.5-MoE (Qwen3-VL's tower and prompt), whose Gated DeltaNet states carry the narration from
one append to the next in the request's own runner row.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.qwen2_vl.preprocess import preprocess_video
from stillcut.engine.request import SamplingParams
from stillcut.vision.pipeline import VisionPipeline

from .models.qwen3_vl.qwen3_reference import hand_pixels

NUM_TUBELETS = 8
MAX_TOKENS_PER_SEGMENT = 5
FPS = 2.0
TOP = 5  # logprobs compared per generated token
VIDEO_TYPE = 2  # transformers' mm_token_type_ids: 0 text, 1 image, 2 video
# (height, width) of the frames: Qwen3-VL's (and Qwen3.5's, its tower) are multiples of 32 that a
# 2-frame clip keeps, so transformers' processor (built by hand) takes them as they are
QWEN3_VL_FRAMES = (96, 128)
FRAME_SIZES = {
    "qwen2_5_vl": (56, 84),
    "qwen3_vl": QWEN3_VL_FRAMES,
    "qwen3_5": QWEN3_VL_FRAMES,
    "qwen3_5_moe": QWEN3_VL_FRAMES,
}


def _narrate(engine, items, params):
    """Narrate `items` under `queue`; returns the sequence, each segment's (start, end, how it
    ended), every token's positions and the generated tokens' top logprobs."""
    processor = engine.processor
    first = items[0]
    prompt = processor.narration_prompt(
        "Describe what happens.", first, processor.tubelet_time(first)
    )
    request_id = engine.add_request(prompt, params, streaming=True)
    segments = []
    for k, item in enumerate(items):
        if k:
            new_ids = processor.narration_input(item, processor.tubelet_time(item))
            engine.append_input(request_id, new_ids, [item])
        request = engine.scheduler.requests[request_id]
        start = request.num_prompt_tokens
        end_reason = None
        while end_reason is None:
            for output in engine.step():
                end_reason = output.segment_end or end_reason
                logprobs = output.logprobs
        segments.append((start, request.num_tokens, end_reason))
    sequence = list(request.prompt_token_ids + request.output_token_ids)
    row = engine.runner.rows[request_id]
    tail = torch.arange(len(sequence) - row.prompt_len) + row.next_position
    positions = torch.cat([row.positions[:, : row.prompt_len], tail.expand(3, -1)], dim=1)
    engine.abort(request_id)
    return sequence, segments, positions, logprobs


def _transformers_media(family, clips, pipeline):
    """What transformers' model takes for the tubelets: their pixels, grids (and for
    Qwen2.5-VL their seconds per grid step; the others take Qwen3-VL's)."""
    if family != "qwen2_5_vl":
        pixels = [hand_pixels(clip) for clip in clips]
        return {
            "pixel_values_videos": torch.cat([patches for patches, _ in pixels]),
            "video_grid_thw": torch.tensor([grid for _, grid in pixels]),
        }
    prepared = [preprocess_video(clip, FPS, pipeline.video_preprocess) for clip in clips]
    return {
        "pixel_values_videos": torch.cat([p.patches for p in prepared]),
        "video_grid_thw": torch.tensor([p.grid_thw for p in prepared]),
        "second_per_grid_ts": torch.tensor([p.second_per_grid_ts for p in prepared]),
    }


@pytest.mark.parametrize("family", sorted(FRAME_SIZES))
def test_narration_equals_transformers_over_the_interleaved_sequence(family):
    from transformers import AutoModelForImageTextToText

    path = cached_checkpoint("tiny", seed=1, family=family)
    engine = LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=2048),
            cache=CacheConfig(num_blocks=256, block_size=16),
        ),
    )
    pipeline = VisionPipeline(path)
    shape = (2 * NUM_TUBELETS, *FRAME_SIZES[family], 3)
    frames = np.random.default_rng(3).integers(0, 256, shape, np.uint8)
    clips = [frames[2 * k : 2 * k + 2] for k in range(NUM_TUBELETS)]
    # each tubelet with its frames' times in the stream: 2k / FPS and (2k + 1) / FPS
    items = [
        replace(pipeline.video(clip, frames_fps=FPS), timestamps=(2 * k / FPS, (2 * k + 1) / FPS))
        for k, clip in enumerate(clips)
    ]
    ends = engine.processor.segment_end_token_ids(["\n"])
    params = SamplingParams(
        max_tokens=MAX_TOKENS_PER_SEGMENT, stop_token_ids=tuple(ends), logprobs=TOP
    )
    sequence, segments, positions, logprobs = _narrate(engine, items, params)

    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([sequence])
    media = _transformers_media(family, clips, pipeline)
    types = (ids == engine.processor.special.video_token_id).int() * VIDEO_TYPE
    hf_positions, _ = reference.model.get_rope_index(ids, types, **media)
    # every token, generated ones included, sits where transformers puts it
    assert torch.equal(positions, hf_positions[:, 0])
    with torch.inference_mode():
        logits = reference(input_ids=ids, mm_token_type_ids=types, **media).logits[0]
    predicted = logits.argmax(-1).tolist()  # [len(sequence)]
    eos = set(engine.eos_token_ids)
    generated_at = [i for start, end, _ in segments for i in range(start, end)]
    assert len(logprobs) == len(generated_at)
    # the whole distribution, not only its argmax (a tiny random model says much the same
    # whatever it sees): each generated token's top logprobs are transformers'
    top = torch.log_softmax(logits[[i - 1 for i in generated_at]], -1).topk(TOP)  # [G, TOP]
    assert [ids for ids, _, _ in logprobs] == top.indices.tolist()
    ours = torch.tensor([values for _, values, _ in logprobs])  # [G, TOP]
    torch.testing.assert_close(ours, top.values, atol=1e-4, rtol=0)
    for start, end, reason in segments:
        generated = sequence[start:end]
        assert generated == predicted[start - 1 : end - 1], (start, end)
        assert not ends & set(generated[:-1]), "a segment-end token inside a segment"
        if reason == "length":
            assert len(generated) == MAX_TOKENS_PER_SEGMENT and generated[-1] not in ends
        elif generated and generated[-1] in ends:
            assert reason == "stop"
        else:  # ended by EOS, which the sequence does not keep
            assert reason == "stop" and predicted[end - 1] in eos
