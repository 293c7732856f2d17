"""Prefix caching of Qwen3.5 (Gated DeltaNet + attention) through recurrent-state snapshots.

On the tiny `qwen3_5` checkpoint and a random clip (four timestamped tubelets, EVS off): a
second, different question about the same video restores the snapshot at the last block
boundary inside the video (or a later one), so it reuses every full block of the video, and
answers with the tokens of a cold run and of transformers' `generate`, logprobs within 1e-4
(restoring a state reorders float32 sums). Two text prompts sharing 40 tokens hit two blocks
with the default snapshot interval (a peer's "align" mode, which snapshots only every few
hundred tokens, cannot hit there). The comparison can fail: with the restored state replaced
by zeros, the answer is another one. A held prefix extended tubelet by tubelet serves forked
questions as fresh requests (the Nemotron module's test, on this module's setup). Both
DeltaNet states are float32 whatever the K/V's dtype.
"""

import types

import pytest
import torch

from stillcut.engine.cache_groups import recurrent_groups, state_bytes_per_request
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.engine.runner import ModelRunner
from stillcut.vision.pipeline import VisionPipeline

from . import test_hybrid_prefix as nemotron_tests
from .models.qwen3_vl.qwen3_reference import hand_pixels, random_frames

BLOCK = 16
MAX_TOKENS = 8
# the sampled tokens' logprobs too: a state restored wrong can leave greedy tokens unchanged
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
QUESTIONS = ("What happens?", "Which colours are there?")


def _engine(path, prefix_caching=True) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_batched_tokens=4096, max_model_len=2048)
    cache = CacheConfig(num_blocks=256, block_size=BLOCK, enable_prefix_caching=prefix_caching)
    return LLMEngine(path, EngineConfig(scheduler=scheduler, cache=cache))


@pytest.fixture(scope="module")
def setup():
    path = cached_checkpoint("tiny", seed=1, family="qwen3_5")
    cold = _engine(path, prefix_caching=False)
    frames = random_frames(8, 128, 160, seed=5)
    item = VisionPipeline(path).video(frames, frames_fps=2.0)
    prompts = [
        cold.processor.build(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": q}]}],
            [item],
        )
        for q in QUESTIONS
    ]
    return types.SimpleNamespace(
        path=path,
        cold=cold,
        frames=frames,
        prompts=prompts,
        cold_outputs=[cold.generate([p], GREEDY)[0] for p in prompts],
    )


test_a_held_prefix_extended_by_tubelets_serves_forks_like_fresh_requests = (
    nemotron_tests.test_a_held_prefix_extended_by_tubelets_serves_forks_like_fresh_requests
)


def _sampled_logprobs(output) -> list[float]:
    return [logprob for *_, logprob in output.logprobs]


def _assert_same(ours, cold) -> None:
    """The same greedy tokens, with the same logprobs up to float rounding."""
    assert ours.token_ids == cold.token_ids
    assert _sampled_logprobs(ours) == pytest.approx(_sampled_logprobs(cold), abs=1e-4)


def _transformers_answer(setup, prompt) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after `prompt` and their logprobs."""
    from transformers import AutoModelForImageTextToText

    reference = AutoModelForImageTextToText.from_pretrained(setup.path).eval()
    ids = torch.tensor([prompt.token_ids])
    video_token_id = setup.cold.processor.special.video_token_id
    patches, grid = hand_pixels(setup.frames)
    with torch.inference_mode():
        out = reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=2 * (ids == video_token_id).int(),
            pixel_values_videos=patches,
            video_grid_thw=torch.tensor([grid]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(logits[0].float(), -1)[token])
        for logits, token in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def _ask_twice(setup, engine: LLMEngine):
    """The second question's output after the first one ran on `engine`."""
    first, second = setup.prompts
    (ours,) = engine.generate([first], GREEDY)
    assert ours.metrics.num_cached_tokens == 0
    (ours,) = engine.generate([second], GREEDY)
    return ours


def test_a_second_question_reuses_every_full_block_of_the_video(setup):
    engine = _engine(setup.path)
    ours = _ask_twice(setup, engine)
    second = setup.prompts[1]
    video_end = second.mm_positions[-1].end
    assert ours.metrics.num_cached_tokens >= video_end // BLOCK * BLOCK
    assert engine.scheduler.kv_cache.snapshots.num_restored == 1
    _assert_same(ours, setup.cold_outputs[1])
    tokens, logprobs = _transformers_answer(setup, second)
    assert ours.token_ids == tokens
    assert _sampled_logprobs(ours) == pytest.approx(logprobs, abs=1e-4)


def test_two_prompts_sharing_40_tokens_hit_two_blocks(setup):
    engine = _engine(setup.path)
    shared = list(range(200, 240))
    prompts = [shared + list(range(500, 505)), shared + list(range(600, 609))]
    outputs = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert outputs[1].metrics.num_cached_tokens == 2 * BLOCK
    for ours, prompt in zip(outputs, prompts, strict=True):
        _assert_same(ours, setup.cold.generate([prompt], GREEDY)[0])


def test_the_comparison_fails_when_the_restored_state_is_replaced_by_zeros(setup, monkeypatch):
    engine = _engine(setup.path)
    add_row = ModelRunner._add_row

    def add_row_restoring_zeros(runner, new):
        add_row(runner, new)
        if new.restore_slot is not None:
            row = runner.rows[new.request_id].row
            for states in runner.recurrent_states.values():
                for tensor in states:
                    tensor[row] = 0

    monkeypatch.setattr(ModelRunner, "_add_row", add_row_restoring_zeros)
    ours = _ask_twice(setup, engine)
    assert ours.metrics.num_cached_tokens > 0  # it did restore (zeros)
    with pytest.raises(AssertionError):
        _assert_same(ours, setup.cold_outputs[1])


def test_delta_net_states_are_float32_whatever_the_kv_dtype(setup):
    groups = setup.cold.cache_groups
    (recurrent,) = recurrent_groups(groups)
    assert recurrent.dtype == torch.float32
    runner = ModelRunner(
        setup.cold.model,
        groups,
        num_blocks=4,
        block_size=BLOCK,
        max_num_reqs=2,
        max_num_batched_tokens=64,
        max_model_len=64,
        kv_dtype=torch.bfloat16,
        num_state_snapshots=3,
    )
    assert runner.kv_caches[0].dtype == torch.bfloat16
    for layers in (runner.recurrent_states, runner.state_snapshots):
        assert {t.dtype for states in layers.values() for t in states} == {torch.float32}
    # the pool's sizing counts them at 4 bytes a value, whatever the K/V's dtype
    assert state_bytes_per_request(groups, 2) == state_bytes_per_request(groups, 4)
