"""Gemma 3 in the engine equals transformers' Gemma3ForConditionalGeneration.

The tiny random checkpoint has local layers with a window of 8 (every prompt here is longer),
a global layer with its own RoPE base and linear scaling x8, and 16 tokens per image. Prompts
are built by our processor and checked against transformers' Gemma3Processor, which also makes
the reference inputs (a video's three frames are three images there). Greedy tokens must equal
transformers' `generate`, alone and all at once under a token budget that chunks the text
around the images; prefill logits must agree within 1e-4. With EVS on, `generate` would place
the pruned frames densely, so the reference is a greedy loop over transformers' forward with our
kept embeddings, our position ids and the mask spelled out.
"""

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from stillcut.engine.admission import BidirectionalItemTooLong
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.loader import checkpoint_tensors
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline

from ...reference import hf_greedy, prefill_logits

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
TOLERANCE = 1e-4
FPS = 2.0
CASES = {
    "one image": [("image", "a"), ("text", "What is in the picture?")],
    "three frames": [("video", "clip"), ("text", "What happens in the video?")],
    "text before and after": [
        ("text", "First look at this picture:"),
        ("image", "b"),
        ("text", "then at this clip:"),
        ("video", "clip"),
        ("text", "Compare them, please."),
    ],
}


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    path = cached_checkpoint("tiny", family="gemma3")
    engine = LLMEngine(path, _config(max_num_batched_tokens=1024))
    reference = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return engine, VisionPipeline(path), reference, AutoProcessor.from_pretrained(path)


def _config(max_num_batched_tokens: int, block_size: int = 16, **cache) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=512),
        cache=CacheConfig(num_blocks=256, block_size=block_size, **cache),
    )


def _media() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a": rng.integers(0, 256, (50, 70, 3), dtype=np.uint8),
        "b": rng.integers(0, 256, (80, 60, 3), dtype=np.uint8),
        "c": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
        "clip": rng.integers(0, 256, (3, 48, 64, 3), dtype=np.uint8),
    }


def _build(setup, parts, evs=None):
    """Our prompt and transformers' inputs for `parts` ((kind, text or media name) pairs)."""
    from PIL import Image

    engine, pipeline, _, processor = setup
    media = _media()
    inputs = [
        ImageInput(media[v]) if k == "image" else VideoInput(media[v], evs=evs, frames_fps=FPS)
        for k, v in parts
        if k != "text"
    ]
    ours = [{"type": "text", "text": v} if k == "text" else {"type": k} for k, v in parts]
    prompt = engine.processor.build([{"role": "user", "content": ours}], pipeline.encode(inputs))
    theirs = []
    for kind, value in parts:
        if kind == "text":
            theirs.append({"type": "text", "text": value})
        else:
            images = media[value] if kind == "video" else [media[value]]
            theirs.extend({"type": "image", "image": Image.fromarray(f)} for f in images)
    hf_inputs = processor.apply_chat_template(
        [{"role": "user", "content": theirs}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    return prompt, hf_inputs


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_and_greedy_tokens_equal_transformers(setup, case):
    engine, _, reference, _ = setup
    prompt, hf_inputs = _build(setup, CASES[case])
    assert prompt.token_ids == hf_inputs["input_ids"][0].tolist()
    # every image and frame is its own bidirectional block: transformers' token types
    image_rows = torch.tensor(prompt.token_ids) == engine.model.image_token_id
    assert image_rows.tolist() == hf_inputs["token_type_ids"][0].bool().tolist()
    assert all(item.bidirectional and item.num_tokens == 16 for item in prompt.items)
    (ours,) = engine.generate([prompt], GREEDY)
    assert ours.token_ids == hf_greedy(reference, hf_inputs, NUM_NEW_TOKENS)


def test_a_checkpoint_storing_siglips_pooling_head_answers_as_transformers():
    """SigLIP's default `vision_use_head: true` stores a pooling head that Gemma 3 never
    reads (transformers' model builds it and ignores it): it loads, and its head is skipped."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    path = cached_checkpoint("tiny", family="gemma3", vision={"vision_use_head": True})
    assert any(".head." in name for name in checkpoint_tensors(path))
    reference = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(path, _config(max_num_batched_tokens=1024))
    setup = (engine, VisionPipeline(path), reference, AutoProcessor.from_pretrained(path))
    prompt, hf_inputs = _build(setup, CASES["text before and after"])
    (ours,) = engine.generate([prompt], GREEDY)
    assert ours.token_ids == hf_greedy(reference, hf_inputs, NUM_NEW_TOKENS)


@pytest.mark.parametrize("case", ["one image", "text before and after"])
def test_prefill_logits_equal_transformers_and_need_the_bidirectional_blocks(setup, case):
    engine, _, reference, _ = setup
    prompt, hf_inputs = _build(setup, CASES[case])
    with torch.inference_mode():
        theirs = reference(**hf_inputs).logits[0]  # [L, vocab]
    ours = prefill_logits(engine.model, prompt)
    assert theirs.abs().max() > 0.1  # the tolerance means something
    assert (ours - theirs).abs().max().item() < TOLERANCE
    causal = replace(prompt, items=[replace(i, bidirectional=False) for i in prompt.items])
    assert (prefill_logits(engine.model, causal)[-1] - theirs[-1]).abs().max() > 1e-2


def test_sliding_windows_and_linear_rope_scaling_are_exercised(setup):
    """The window is shorter than the prompt and the global layer's RoPE is scaled: undoing
    either breaks the agreement with transformers the other tests rely on."""
    engine, _, reference, _ = setup
    prompt, hf_inputs = _build(setup, CASES["text before and after"])
    config = engine.model.config
    assert config.sliding_window < len(prompt.token_ids)
    assert config.rope["full_attention"].factor == 8.0
    assert config.rope["full_attention"].theta != config.rope["sliding_attention"].theta
    with torch.inference_mode():
        theirs = reference(**hf_inputs).logits[0]
    no_window = copy.deepcopy(engine.model)
    for layer in no_window.layers:
        layer.sliding_window = None
    unscaled = copy.deepcopy(engine.model)
    unscaled.rotary.full_attention_inv_freq *= config.rope["full_attention"].factor
    for broken in (no_window, unscaled):
        assert (prefill_logits(broken, prompt) - theirs).abs().max() > 1e-2


def test_requests_in_flight_with_chunked_prefill_equal_one_at_a_time(setup):
    engine = setup[0]
    prompts = [_build(setup, parts)[0] for parts in CASES.values()]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    budget = 24  # above 16 tokens per image, below every prompt: the text around them chunks
    assert all(len(p.token_ids) > budget for p in prompts)
    small = LLMEngine(engine.path, _config(max_num_batched_tokens=budget))
    chunk_ends = _record_chunk_ends(small)
    together = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == alone
    for end, places in chunk_ends:
        assert not any(p.offset < end < p.end for p in places), "an image was split"
    assert any(0 < end < max(p.end for p in places) for end, places in chunk_ends)


def _record_chunk_ends(engine: LLMEngine) -> list:
    """Patch the scheduler to record (chunk end, item placements) of every prefill chunk."""
    scheduler, ends = engine.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            if request.mm_positions:
                ends.append((request.num_computed_tokens + num_tokens, request.mm_positions))
        return output

    scheduler.schedule = recording_schedule
    return ends


def test_an_image_larger_than_the_token_budget_fails_at_start_up(setup):
    with pytest.raises(BidirectionalItemTooLong, match=r"16 tokens.*max_num_batched_tokens=12"):
        LLMEngine(setup[0].path, _config(max_num_batched_tokens=12))


def test_prefix_cache_hits_share_images_and_round_down_to_an_image_start(setup):
    parts = [("text", "Here are two pictures of one street:"), ("image", "a"), ("image", "b")]
    question = ("text", "Which one is darker?")
    first, _ = _build(setup, [*parts, question])
    other, _ = _build(setup, [*parts[:2], ("image", "c"), question])  # same ids, last image not
    assert first.token_ids == other.token_ids
    image_a, image_b = first.mm_positions
    # a block size whose boundaries fall inside image a, and after it inside the block where
    # image b (c) starts: the chain of equal blocks ends inside image a
    block_size = next(
        size
        for size in (4, 8, 16)
        if image_a.offset // size < (image_a.end - 1) // size == image_b.offset // size
        and image_a.offset >= size
    )
    engine = LLMEngine(setup[0].path, _config(max_num_batched_tokens=1024, block_size=block_size))
    (fresh,) = LLMEngine(setup[0].path, _config(1024, enable_prefix_caching=False)).generate(
        [other], GREEDY
    )
    (original,) = engine.generate([first], GREEDY)
    (again,) = engine.generate([first], GREEDY)
    assert again.token_ids == original.token_ids
    assert again.metrics.num_cached_tokens >= image_b.end
    (rounded,) = engine.generate([other], GREEDY)
    assert rounded.token_ids == fresh.token_ids
    # the equal blocks reach into image a; the hit stops at the block boundary below its start
    assert rounded.metrics.num_cached_tokens == image_a.offset // block_size * block_size > 0


def test_evs_frames_keep_their_unpruned_positions_and_equal_transformers(setup):
    engine, _, reference, _ = setup
    frames = _media()["clip"]
    frames[1] = frames[0]  # a static frame: EVS drops all of it
    parts = [("text", "Watch:"), ("video", "clip"), ("text", "What changed?")]
    evs = EVSConfig(mode="rate", rate=0.5)
    dense, pruned = (_build_frames(setup, parts, frames, e) for e in (None, evs))
    assert [item.num_tokens for item in pruned.items] == [16, 0, 8]  # the first frame stays

    dense_positions, dense_next = engine.model.prompt_positions(
        torch.tensor(dense.token_ids), dense.items, dense.mm_positions
    )
    assert dense_positions[0].tolist() == list(range(len(dense.token_ids)))  # transformers'
    assert dense_next == len(dense.token_ids)
    positions, next_position = engine.model.prompt_positions(
        torch.tensor(pruned.token_ids), pruned.items, pruned.mm_positions
    )
    for item, place, dense_place in zip(
        pruned.items, pruned.mm_positions, dense.mm_positions, strict=True
    ):
        index = item.coords[:, 1] * 4 + item.coords[:, 2]  # in the 4 x 4 frame
        kept = positions[0, place.offset : place.end]
        assert kept.tolist() == (dense_positions[0, dense_place.offset + index]).tolist()
    num_after = len(pruned.token_ids) - pruned.mm_positions[-1].end
    assert positions[0, -num_after:].tolist() == dense_positions[0, -num_after:].tolist()
    assert next_position == dense_next

    (ours,) = engine.generate([pruned], GREEDY)
    expected = _hf_greedy_loop(reference, pruned, positions, next_position, engine.model)
    assert ours.token_ids == expected


def _build_frames(setup, parts, frames, evs):
    """`_build`'s prompt for a video of `frames` (EVS allowed)."""
    engine, pipeline, _, _ = setup
    (item,) = pipeline.encode([VideoInput(frames, evs=evs, frames_fps=FPS)])
    ours = [{"type": "text", "text": v} if k == "text" else {"type": k} for k, v in parts]
    return engine.processor.build([{"role": "user", "content": ours}], [item])


def _hf_greedy_loop(reference, prompt, positions, next_position, model) -> list[int]:
    """Greedy tokens of transformers' forward on our kept embeddings, our positions and the
    Gemma 3 mask spelled out: window AND (causal OR same frame), over sequence slots."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt.token_ids])
    embeds = reference.get_input_embeddings()(ids)  # [1, L, hidden], scaled text embeddings
    frame_of = torch.full((ids.shape[1],), -1)
    for frame, place in enumerate(prompt.mm_positions):
        embeds[0, place.offset : place.end] = prompt.items[frame].embeds
        frame_of[place.offset : place.end] = frame
    window = model.config.sliding_window
    query = torch.arange(ids.shape[1])[:, None]
    key = torch.arange(ids.shape[1])[None]
    causal = (key <= query) | ((frame_of[:, None] == frame_of[None]) & (frame_of[:, None] >= 0))
    masks = {"full_attention": causal, "sliding_attention": causal & (query - key < window)}
    cache = DynamicCache()  # full-length caches, so the masks span every key
    tokens, position_ids = [], positions  # [1, L]
    with torch.inference_mode():
        for step in range(NUM_NEW_TOKENS):
            out = reference(
                inputs_embeds=embeds,
                position_ids=position_ids,
                attention_mask={kind: mask[None, None] for kind, mask in masks.items()},
                cache=cache,
                use_cache=True,
            )
            tokens.append(int(out.logits[0, -1].argmax()))
            embeds = reference.get_input_embeddings()(torch.tensor([[tokens[-1]]]))
            position_ids = torch.tensor([[next_position + step]])
            seq_len = ids.shape[1] + step + 1
            key = torch.arange(seq_len)[None]
            masks = {"full_attention": key >= 0, "sliding_attention": seq_len - 1 - key < window}
    return tokens
