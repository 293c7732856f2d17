"""Engine behaviour around the KV cache: prefix hits, held prefixes, preemption, abort,
and bidirectional multimodal items.

The tiny random model greedily repeats its last input token whatever came before, so equal
tokens prove nothing about the KV behind them: answers are compared on their top logprobs
too, which any other input moves by far more than `LOGPROB_ATOL` (computing the same prompt
in other chunks moves them by ~1e-6).
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.vision.pipeline import VisionPipeline

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)
BLOCK = 16
LOGPROB_ATOL = 1e-5


def _engine(path, num_blocks=512, budget=4096, held_share=0.5) -> LLMEngine:
    return LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=2048),
            cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK, held_share=held_share),
        ),
    )


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return _engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return VisionPipeline(tiny_checkpoint)


def _frames(seed, num_frames=4):
    return np.random.default_rng(seed).integers(0, 256, (num_frames, 56, 84, 3), dtype=np.uint8)


def _ask(engine, item, question):
    parts = [{"type": "video"}, {"type": "text", "text": question}]
    return engine.processor.build([{"role": "user", "content": parts}], [item])


def _logprob_gap(output, other) -> float:
    """The largest difference between two answers' top logprobs; inf if their tokens or top
    tokens differ."""
    tops = [[ids for ids, _, _ in o.logprobs] for o in (output, other)]
    if output.token_ids != other.token_ids or tops[0] != tops[1]:
        return float("inf")
    values = [np.array([top for _, top, _ in o.logprobs]) for o in (output, other)]
    return float(np.abs(values[0] - values[1]).max())


def _assert_same_answer(output, expected) -> None:
    assert len(output.logprobs) == len(output.token_ids) > 0
    assert _logprob_gap(output, expected) <= LOGPROB_ATOL


def _assert_pool_whole(engine):
    kv = engine.scheduler.kv_cache
    assert not engine.has_unfinished_requests()
    kv.check_consistency()
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


def test_same_video_hits_the_prefix_and_encoder_caches(engine, pipeline):
    first_item = pipeline.video(_frames(0), frames_fps=2.0)
    (first,) = engine.generate([_ask(engine, first_item, "What moves?")], GREEDY)
    # the answer depends on the video: the same question about another tells them apart
    other_item = pipeline.video(_frames(3), frames_fps=2.0)
    (other,) = engine.generate([_ask(engine, other_item, "What moves?")], GREEDY)
    assert other.token_ids == first.token_ids and _logprob_gap(other, first) > 100 * LOGPROB_ATOL
    again_item = pipeline.video(_frames(0), frames_fps=2.0)
    assert again_item.stats["cache_hit"]  # the encoder did not run again
    (again,) = engine.generate([_ask(engine, again_item, "What moves?")], GREEDY)
    assert again.metrics.num_cached_tokens >= first.metrics.num_prompt_tokens - BLOCK
    _assert_same_answer(again, first)  # the cached KV is the video's
    _assert_pool_whole(engine)


def test_other_video_with_equal_token_ids_reuses_nothing_from_its_first_video_token(
    engine, pipeline
):
    item = pipeline.video(_frames(1), frames_fps=2.0)
    other = pipeline.video(_frames(2), frames_fps=2.0)
    assert other.num_tokens == item.num_tokens and other.identifier != item.identifier
    prompt, other_prompt = _ask(engine, item, "Same words."), _ask(engine, other, "Same words.")
    assert prompt.token_ids == other_prompt.token_ids
    engine.generate([prompt], GREEDY)
    (result,) = engine.generate([other_prompt], GREEDY)
    first_video_token = other_prompt.mm_positions[0].offset
    assert result.metrics.num_cached_tokens <= first_video_token // BLOCK * BLOCK
    (fresh,) = _engine(engine.path).generate([other_prompt], GREEDY)
    _assert_same_answer(result, fresh)
    _assert_pool_whole(engine)


def test_held_prefix_extended_three_times_with_forks(tiny_checkpoint, pipeline):
    engine = _engine(tiny_checkpoint)
    processor = engine.processor
    tubelets = [pipeline.video(_frames(10 + k, 2), frames_fps=2.0) for k in range(4)]
    # one logical video: tubelet k sits at t = k of a grid that grows with the stream
    tubelets = [
        replace(
            item,
            identifier=f"session-{k}",
            coords=item.coords + torch.tensor([k, 0, 0]),
            grid_thw=(k + 1, *item.grid_thw[1:]),
        )
        for k, item in enumerate(tubelets)
    ]
    prefix = processor.vision_prefix(tubelets[:1])
    held = engine.add_request(prefix, hold=True)
    prefilled = _run_until_idle(engine)
    assert prefilled[held] == len(prefix.token_ids)
    for k in range(1, 4):
        question = processor.ask_suffix(f"What happened by tubelet {k}?")
        fork_prompt = processor.vision_prefix(tubelets[:k])
        fork = _fork(engine, fork_prompt, question)
        reference = _engine(tiny_checkpoint).generate([_joined(fork_prompt, question)], GREEDY)[0]
        _assert_same_answer(fork, reference)
        assert (
            fork.metrics.num_prompt_tokens - fork.metrics.num_cached_tokens <= len(question) + BLOCK
        )
        pads = [processor.special.video_token_id] * tubelets[k].num_tokens
        engine.append_input(held, pads, [tubelets[k]])
        assert _run_until_idle(engine)[held] == len(pads)  # only the new tokens are prefilled
    engine.release_held(held)
    _run_until_idle(engine)
    _assert_pool_whole(engine)


def _joined(prefix, suffix_ids):
    from stillcut.engine.processor import Prompt

    return Prompt(prefix.token_ids + suffix_ids, prefix.items, prefix.mm_positions)


def _fork(engine, prefix, question):
    (output,) = engine.generate([_joined(prefix, question)], GREEDY)
    return output


def _run_until_idle(engine) -> dict[str, int]:
    """Step until nothing is left to run; tokens computed per request."""
    computed: dict[str, int] = {}
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        for request_id, n in scheduled.num_scheduled_tokens.items():
            computed[request_id] = computed.get(request_id, 0) + n
        result = engine.runner.execute(scheduled)
        engine.scheduler.update_from_output(scheduled, result.sampled)
    return computed


def test_preemption_gives_the_same_tokens(tiny_checkpoint, pipeline):
    items = [pipeline.video(_frames(20 + k), frames_fps=2.0) for k in range(3)]
    roomy = _engine(tiny_checkpoint)
    prompts = [_ask(roomy, item, f"Question {k}") for k, item in enumerate(items)]
    params = replace(GREEDY, max_tokens=40)
    expected = roomy.generate(prompts, params)
    longest = max(len(p.token_ids) for p in prompts) + params.max_tokens
    tight = _engine(tiny_checkpoint, num_blocks=-(-longest // BLOCK) + 2, held_share=0.0)
    preempted = []
    original = tight.scheduler._preempt

    def counting(request):
        preempted.append(request.request_id)
        original(request)

    tight.scheduler._preempt = counting
    for output, reference in zip(tight.generate(prompts, params), expected, strict=True):
        _assert_same_answer(output, reference)
    assert preempted, "the KV budget was meant to force preemption"
    _assert_pool_whole(tight)


def test_abort_mid_generation_frees_every_block(engine, pipeline):
    item = pipeline.video(_frames(30), frames_fps=2.0)
    request_id = engine.add_request(_ask(engine, item, "Go on."), SamplingParams(max_tokens=50))
    other = engine.add_request(_ask(engine, item, "And this?"), GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.abort(other)  # already finished
    _assert_pool_whole(engine)


def test_bidirectional_items_match_a_dense_masked_reference(tiny_checkpoint, pipeline):
    from transformers import AutoModelForImageTextToText

    engine = _engine(tiny_checkpoint)
    item = pipeline.video(_frames(40, 2), frames_fps=2.0)
    prompt = _ask(engine, item, "Both ways?")
    bidirectional = replace(item, bidirectional=True)
    both_prompt = replace(prompt, items=[bidirectional])
    causal_logits = _prefill_logits(engine, prompt)
    both_logits = _prefill_logits(engine, both_prompt)
    assert not torch.allclose(causal_logits, both_logits, atol=1e-3)

    reference = AutoModelForImageTextToText.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    ids = torch.tensor(prompt.token_ids)
    n = len(ids)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    place = prompt.mm_positions[0]
    mask[place.offset : place.end, place.offset : place.end] = True
    embeds = reference.get_input_embeddings()(ids[None])
    embeds[0, place.offset : place.end] = item.embeds
    positions, _ = engine.model.prompt_positions(ids, prompt.items)
    with torch.inference_mode():
        out = reference(
            inputs_embeds=embeds,
            position_ids=positions[:, None, :],
            attention_mask=mask[None, None],
        )
    torch.testing.assert_close(both_logits, out.logits[0, -1], rtol=0, atol=1e-4)


def _prefill_logits(engine, prompt) -> torch.Tensor:
    """Logits of the last prompt token, from one prefill step of our engine."""
    captured = []
    compute_logits = engine.model.compute_logits

    def capture(hidden):
        logits = compute_logits(hidden)
        captured.append(logits[0].clone())
        return logits

    engine.model.compute_logits = capture
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    finally:
        del engine.model.compute_logits
    return captured[0]
