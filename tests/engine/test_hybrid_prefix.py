"""Prefix caching of a hybrid (Mamba2 + attention) model through recurrent-state snapshots.

On the tiny Nemotron 3 Nano Omni checkpoint and a real clip (four tubelets, EVS off): a second
question about the same video restores the snapshot at the end of the video's last tubelet
and gives exactly the tokens of a cold run and of transformers' `generate`; with that
snapshot's blocks reused it restarts from a shallower snapshot, and with none left from
token 0, same tokens. With a snapshot at every block, text prompts of two and three blocks hit.
A held prefix extended tubelet by tubelet serves forked questions with the tokens fresh
requests get, and leaves every block, slot and snapshot free.
"""

import types

import pytest

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.pipeline import VideoInput, VisionPipeline

from .models.nemotron_omni.nemotron_reference import NemotronReference

BLOCK = 16
# the sampled tokens' logprobs too: a state restored wrong can leave greedy tokens unchanged
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
DECODE = DecodeConfig(fps=2.0, max_frames=8)
QUESTIONS = ("What happens?", "Which colours are there?")


def _engine(path, prefix_caching=True, num_blocks=256, held_share=0.5, **cache) -> LLMEngine:
    scheduler = SchedulerConfig(max_num_batched_tokens=4096, max_model_len=2048)
    cache_config = CacheConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        held_share=held_share,
        enable_prefix_caching=prefix_caching,
        **cache,
    )
    return LLMEngine(path, EngineConfig(scheduler=scheduler, cache=cache_config))


@pytest.fixture(scope="module")
def setup(samples_dir):
    path = cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    clip = samples_dir / "moving_object.mp4"
    cold = _engine(path, prefix_caching=False)
    item = VisionPipeline(path, decode_config=DECODE).encode([VideoInput(clip, evs=None)])[0]
    messages = [
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": q}]}]
        for q in QUESTIONS
    ]
    prompts = [cold.processor.build(m, [item]) for m in messages]
    return types.SimpleNamespace(
        path=path,
        cold=cold,
        clip=clip,
        messages=messages,
        prompts=prompts,
        cold_outputs=[cold.generate([p], GREEDY)[0] for p in prompts],
    )


def _assert_same(ours, cold) -> None:
    """The same greedy tokens, with the same logprobs up to float rounding."""
    assert ours.token_ids == cold.token_ids
    sampled = [[logprob for *_, logprob in o.logprobs] for o in (ours, cold)]
    assert sampled[0] == pytest.approx(sampled[1], abs=1e-4)


def _assert_all_free(engine: LLMEngine) -> None:
    engine.step()  # rows of requests that finished in the last step are dropped at the next
    kv = engine.scheduler.kv_cache
    kv.check_consistency()  # every snapshot slot free or saved under a cached block
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.runner.rows
    assert kv.reset_prefix_cache()  # every slot comes back
    assert kv.snapshots.num_free_slots == kv.snapshots.num_slots


def _last_video_block_end(prompt) -> int:
    """Tokens up to the last block boundary inside the video: the shared restart point."""
    return prompt.mm_positions[-1].end // BLOCK * BLOCK


def test_a_second_question_restores_a_snapshot_and_equals_cold_and_transformers(setup):
    engine = _engine(setup.path)
    first, second = setup.prompts
    (ours,) = engine.generate([first], GREEDY)
    assert ours.metrics.num_cached_tokens == 0
    snapshots = engine.scheduler.kv_cache.snapshots
    assert snapshots.num_saved > 0 and snapshots.num_restored == 0
    (ours,) = engine.generate([second], GREEDY)
    assert ours.metrics.num_cached_tokens == _last_video_block_end(second) > 0
    assert snapshots.num_restored == 1
    _assert_same(ours, setup.cold_outputs[1])
    reference = NemotronReference(setup.path)
    media = reference.video(setup.clip, DECODE)
    expected_ids = reference.prompt_ids(setup.messages[1], media)
    assert second.token_ids == expected_ids
    assert ours.token_ids == reference.greedy(expected_ids, media, 0.0, GREEDY.max_tokens)
    _assert_all_free(engine)


def test_an_evicted_snapshot_falls_back_to_a_shallower_one_then_to_token_zero(setup):
    first, second = setup.prompts
    num_first_blocks = -(-(len(first.token_ids) + GREEDY.max_tokens) // BLOCK)
    engine = _engine(
        setup.path, num_blocks=num_first_blocks + 5, held_share=0.0, num_state_snapshots=8
    )
    engine.generate([first], GREEDY)
    # Freed blocks queue last block first behind the 5 never used: 120 + 8 tokens of text
    # take those 5 and the first's last 3 blocks, the deepest of which held the snapshot at
    # the end of the video's last tubelet.
    text = list(range(300, 420))
    snapshots = engine.scheduler.kv_cache.snapshots
    num_evicted = snapshots.num_evicted
    engine.generate([text], GREEDY)
    assert snapshots.num_evicted > num_evicted
    (ours,) = engine.generate([second], GREEDY)
    # the restart point before: the end of the third tubelet
    assert ours.metrics.num_cached_tokens == second.mm_positions[-2].end // BLOCK * BLOCK
    _assert_same(ours, setup.cold_outputs[1])
    assert engine.scheduler.kv_cache.reset_prefix_cache()
    (ours,) = engine.generate([second], GREEDY)
    assert ours.metrics.num_cached_tokens == 0
    _assert_same(ours, setup.cold_outputs[1])
    _assert_all_free(engine)


def test_prompts_of_two_and_three_blocks_hit_with_a_snapshot_every_block(setup):
    engine = _engine(setup.path, mamba_snapshot_interval=1)
    for num_shared in (37, 40):  # two blocks and a part, three blocks less a part
        shared = list(range(200, 200 + num_shared))
        prompts = [shared + list(range(500, 505)), shared + list(range(600, 609))]
        outputs = [engine.generate([p], GREEDY)[0] for p in prompts]
        assert outputs[1].metrics.num_cached_tokens == num_shared // BLOCK * BLOCK
        for ours, prompt in zip(outputs, prompts, strict=True):
            _assert_same(ours, setup.cold.generate([prompt], GREEDY)[0])
    _assert_all_free(engine)


def test_a_held_prefix_extended_by_tubelets_serves_forks_like_fresh_requests(setup):
    engine = _engine(setup.path)
    prompt = setup.prompts[0]
    ids, items, places = prompt.token_ids, prompt.items, prompt.mm_positions
    suffix = ids[places[-1].end :]  # after the last tubelet: the question and the template
    held = engine.add_request(ids[: places[0].end], mm_items=items[:1], hold=True)
    forks, fresh, asked = [], [], (1, len(items))  # questions after the first and the last
    for num_tubelets in range(1, len(items) + 1):
        if num_tubelets > 1:
            start, end = places[num_tubelets - 2].end, places[num_tubelets - 1].end
            engine.append_input(held, ids[start:end], items[num_tubelets - 1 : num_tubelets])
        _run(engine)
        if num_tubelets in asked:
            fork = ids[: places[num_tubelets - 1].end] + suffix
            forks.append(_generate(engine, fork, items[:num_tubelets]))
            fresh.append(_generate(setup.cold, fork, items[:num_tubelets]))
    for ours, cold in zip(forks, fresh, strict=True):
        _assert_same(ours, cold)
    # each fork restarts from the held prefix's snapshot at its last full block
    cached = [f.metrics.num_cached_tokens for f in forks]
    assert cached == [places[n - 1].end // BLOCK * BLOCK for n in asked]
    engine.release_held(held)
    _assert_all_free(engine)


def test_streaming_requests_are_refused_since_mamba2_treats_prompt_tokens_apart(setup):
    with pytest.raises(ValueError, match="compute prompt tokens otherwise than generated ones"):
        setup.cold.add_request(list(range(100, 120)), GREEDY, streaming=True)


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _generate(engine: LLMEngine, token_ids, items):
    request_id = engine.add_request(token_ids, GREEDY, mm_items=items)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
