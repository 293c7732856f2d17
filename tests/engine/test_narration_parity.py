"""A narration (EVS off) equals transformers run once over the sequence it produced.

A streaming request narrates 8 tubelets: the instruction, then per tubelet its timestamp text
and the tubelet as its own video, then a segment the model generates until a segment-end token
(any token holding a newline), `max_tokens` or EOS (not kept). Transformers' own model is then
fed the whole sequence (prompt, every tubelet's pixels, every segment) in one forward with its
own positions (`get_rope_index`): at every generated position its argmax is our token, and
each segment ends where the rules say.
"""

import numpy as np
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.qwen2_vl.preprocess import preprocess_video
from stillcut.engine.request import SamplingParams
from stillcut.vision.pipeline import VisionPipeline

NUM_TUBELETS = 8
MAX_TOKENS_PER_SEGMENT = 5
FPS = 2.0
VIDEO_TYPE = 2  # transformers' mm_token_type_ids: 0 text, 1 image, 2 video


def _narrate(engine, items, params):
    """Narrate `items` under `queue`; returns the sequence and each segment's (start, end,
    how it ended)."""
    processor = engine.processor
    prompt = processor.narration_prompt("Describe what happens.", items[0], 0.0)
    request_id = engine.add_request(prompt, params, streaming=True)
    segments = []
    for k, item in enumerate(items):
        if k:
            engine.append_input(request_id, processor.narration_input(item, k / FPS * 2), [item])
        request = engine.scheduler.requests[request_id]
        start = request.num_prompt_tokens
        end_reason = None
        while end_reason is None:
            for output in engine.step():
                end_reason = output.segment_end or end_reason
        segments.append((start, request.num_tokens, end_reason))
    sequence = list(request.prompt_token_ids + request.output_token_ids)
    row = engine.runner.rows[request_id]
    tail = torch.arange(len(sequence) - row.prompt_len) + row.next_position
    positions = torch.cat([row.positions[:, : row.prompt_len], tail.expand(3, -1)], dim=1)
    engine.abort(request_id)
    return sequence, segments, positions


def test_narration_equals_transformers_over_the_interleaved_sequence():
    from transformers import AutoModelForImageTextToText

    path = cached_checkpoint("tiny", seed=1, family="qwen2_5_vl")
    engine = LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=2048),
            cache=CacheConfig(num_blocks=256, block_size=16),
        ),
    )
    pipeline = VisionPipeline(path)
    frames = np.random.default_rng(3).integers(0, 256, (2 * NUM_TUBELETS, 56, 84, 3), np.uint8)
    clips = [frames[2 * k : 2 * k + 2] for k in range(NUM_TUBELETS)]
    items = [pipeline.video(clip, frames_fps=FPS) for clip in clips]
    ends = engine.processor.segment_end_token_ids(["\n"])
    params = SamplingParams(max_tokens=MAX_TOKENS_PER_SEGMENT, stop_token_ids=tuple(ends))
    sequence, segments, positions = _narrate(engine, items, params)

    prepared = [preprocess_video(clip, FPS, pipeline.video_preprocess) for clip in clips]
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([sequence])
    grids = torch.tensor([p.grid_thw for p in prepared])
    seconds = torch.tensor([p.second_per_grid_ts for p in prepared])
    types = (ids == engine.processor.special.video_token_id).int() * VIDEO_TYPE
    hf_positions, _ = reference.model.get_rope_index(
        ids, types, video_grid_thw=grids, second_per_grid_ts=seconds
    )
    # every token, generated ones included, sits where transformers puts it
    assert torch.equal(positions, hf_positions[:, 0])
    with torch.inference_mode():
        logits = reference(
            input_ids=ids,
            pixel_values_videos=torch.cat([p.patches for p in prepared]),
            video_grid_thw=grids,
            second_per_grid_ts=seconds,
        ).logits[0]  # [len(sequence), vocab]
    predicted = logits.argmax(-1).tolist()
    eos = set(engine.eos_token_ids)
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
