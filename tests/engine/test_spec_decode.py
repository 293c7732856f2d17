"""Speculative decoding gives exactly the tokens of decoding without it.

For tiny Qwen2.5-VL, Gemma 3, Qwen3-VL and Qwen3-VL-MoE checkpoints (Qwen3-VL's video as
timestamped tubelets with DeepStack features, its verify steps through the experts) and the
n-gram and suffix proposers: greedy output with speculation equals greedy output without it,
for text, video (EVS on and off) and image prompts submitted together under a small token
budget (chunked prefill, batching), with preemption forced, and with a stop string that ends
inside an accepted run; text prompts also equal transformers' `generate`. Every case asserts
that drafts were proposed, some accepted and some rejected, and that every block is free
afterwards. The Qwen checkpoints are built with a wide initialisation so their greedy text
varies (the default repeats one token forever).
"""

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
CHECKPOINTS = {
    "qwen2_5_vl": {"family": "qwen2_5_vl", "text": {"initializer_range": 0.2}},
    "gemma3": {"family": "gemma3"},
    # seeds whose greedy text repeats itself in part, so drafts are both accepted and rejected
    "qwen3_vl": {"family": "qwen3_vl", "seed": 2, "text": {"initializer_range": 0.2}},
    "qwen3_vl_moe": {"family": "qwen3_vl_moe", "seed": 2, "text": {"initializer_range": 0.2}},
}
METHODS = ("ngram", "suffix")


def engine_config(
    speculative: SpeculativeConfig | None = None,
    max_num_batched_tokens: int = 4096,
    num_blocks: int = 512,
) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=1024
        ),
        cache=CacheConfig(num_blocks=num_blocks, block_size=16, held_share=0.0),
        speculative=speculative,
    )


def pinned(method: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=k, dynamic=False)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def setup(request):
    path = cached_checkpoint("tiny", **{"seed": 0, **CHECKPOINTS[request.param]})
    base = LLMEngine(path, engine_config())
    prompts = _prompts(base, VisionPipeline(path))
    expected = [o.token_ids for o in base.generate(list(prompts.values()), GREEDY)]
    engines = {}

    def engine(method, **config):
        """One speculating engine per setting, shared by this module's tests."""
        key = (method, *sorted(config.items()))
        if key not in engines:
            engines[key] = LLMEngine(path, engine_config(pinned(method), **config))
        return engines[key]

    return path, base, prompts, dict(zip(prompts, expected, strict=True)), engine


def _prompts(engine, pipeline):
    """Repeated text (the n-gram proposer fires) and media with a question."""
    rng = np.random.default_rng(0)
    clip = VideoInput(rng.integers(0, 256, (4, 56, 84, 3), dtype=np.uint8), frames_fps=2.0)
    image = ImageInput(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8))
    pruned = VideoInput(clip.source, frames_fps=2.0, evs=EVSConfig(mode="rate", rate=0.5))
    text = "one two three four, one two three four, one two three four, one two"
    cases = {"text": ([], text)}
    cases["image"] = ([image], "Describe the picture, then describe it again.")
    if engine.model_config.family.model_type != "gemma3":  # Gemma 3 takes frames as images
        cases["video"] = ([clip], "What happens? What happens?")
        cases["video evs"] = ([pruned], "What happens? What happens?")
    prompts = {}
    for name, (media, question) in cases.items():
        items = pipeline.encode(media) if media else []
        parts = [{"type": "image" if isinstance(m, ImageInput) else "video"} for m in media]
        parts.append({"type": "text", "text": question})
        prompts[name] = engine.processor.build([{"role": "user", "content": parts}], items)
    return prompts


def _hf_greedy(path, token_ids) -> list[int]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([token_ids]),
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(token_ids) :].tolist()


def _assert_drafts_mixed(outputs):
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert 0 < accepted < drafted, (drafted, accepted)


def _assert_pool_whole(engine):
    kv = engine.scheduler.kv_cache
    assert not engine.has_unfinished_requests()
    kv.check_consistency()
    assert kv.num_free_blocks == len(kv.block_pool.blocks)
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


@pytest.mark.parametrize("method", METHODS)
def test_text_equals_transformers_generate(setup, method):
    path, _, prompts, expected, engine_for = setup
    engine = engine_for(method)
    (ours,) = engine.generate([prompts["text"]], GREEDY)
    assert ours.token_ids == expected["text"] == _hf_greedy(path, prompts["text"].token_ids)
    _assert_drafts_mixed([ours])
    _assert_pool_whole(engine)


@pytest.mark.parametrize("method", METHODS)
def test_every_prompt_batched_with_chunked_prefill_equals_no_speculation(setup, method):
    _, _, prompts, expected, engine_for = setup
    engine = engine_for(method, max_num_batched_tokens=64)
    # the suffix proposer gets each question twice: the second finds the first's answer
    names = list(prompts) * (2 if method == "suffix" else 1)
    outputs = engine.generate([prompts[n] for n in names], GREEDY)
    assert [o.token_ids for o in outputs] == [expected[n] for n in names]
    _assert_drafts_mixed(outputs)
    _assert_pool_whole(engine)


def test_preempted_speculating_requests_equal_no_speculation(setup):
    _, _, prompts, expected, engine_for = setup
    names = ["text", "image", "text", "image"]
    num_blocks = max(-(-(len(p.token_ids) + NUM_NEW_TOKENS) // 16) for p in prompts.values()) + 3
    engine = engine_for("ngram", num_blocks=num_blocks)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda r: (preempted.append(r.request_id), preempt(r))
    outputs = engine.generate([prompts[n] for n in names], GREEDY)
    assert preempted
    assert [o.token_ids for o in outputs] == [expected[n] for n in names]
    _assert_drafts_mixed(outputs)
    _assert_pool_whole(engine)


def test_stop_string_inside_an_accepted_run_ends_where_it_would_without(setup):
    _, base, prompts, expected, engine_for = setup
    engine = engine_for("ngram")
    request_id = engine.add_request(prompts["text"], GREEDY)
    runs = []  # tokens each step produced
    while engine.has_unfinished_requests():
        runs += [o.new_token_ids for o in engine.step() if o.request_id == request_id]
    tokens, decode = expected["text"], base.processor.tokenizer.decode
    stop, end = _stop_inside_a_run(runs, tokens, decode)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, stop=(stop,))
    (without,) = base.generate([prompts["text"]], params)
    (ours,) = engine.generate([prompts["text"]], params)
    assert without.token_ids == tokens[: end + 1]  # the stop completes there, not earlier
    assert ours.finish_reason == without.finish_reason == "stop"
    assert ours.token_ids == without.token_ids and ours.text == without.text
    assert len(ours.logprobs) == len(without.logprobs)
    _assert_pool_whole(engine)


def _stop_inside_a_run(runs, tokens, decode) -> tuple[str, int]:
    """A stop string that first completes at the first token (index `end`) of a step that
    produced several: the text of the tokens before it and of it, as short as is unique."""
    text = decode(tokens)
    for i, run in enumerate(runs):
        end = sum(map(len, runs[:i]))
        if len(run) < 2 or end == 0:
            continue
        for start in range(end, -1, -1):
            stop = decode(tokens[start : end + 1])
            if stop and text.find(stop) + len(stop) == len(decode(tokens[: end + 1])):
                return stop, end
    raise AssertionError(f"no verify step accepted a draft: {runs}")


def test_aborted_speculating_request_frees_everything(setup):
    _, _, prompts, _, engine_for = setup
    engine = engine_for("ngram")
    request_id = engine.add_request(prompts["text"], GREEDY)
    while not engine.scheduler.requests[request_id].spec_token_ids:
        engine.step()
    engine.step()  # a verify step ran; drafts for the next one are proposed
    assert engine.scheduler.requests[request_id].num_draft_tokens > 0
    assert engine.abort(request_id)
    engine.step()  # the runner drops the row
    _assert_pool_whole(engine)


def test_penalties_and_logprobs_apply_to_accepted_tokens_as_without(setup):
    _, base, prompts, _, engine_for = setup
    params = SamplingParams(
        max_tokens=NUM_NEW_TOKENS, ignore_eos=True, frequency_penalty=0.05, logprobs=2
    )
    (without,) = base.generate([prompts["text"]], params)
    (ours,) = engine_for("ngram").generate([prompts["text"]], params)
    assert ours.token_ids == without.token_ids
    assert [ids for ids, _, _ in ours.logprobs] == [ids for ids, _, _ in without.logprobs]
    np.testing.assert_allclose(
        [lp for _, _, lp in ours.logprobs], [lp for _, _, lp in without.logprobs], atol=1e-4
    )
    assert ours.metrics.num_draft_tokens > 0
