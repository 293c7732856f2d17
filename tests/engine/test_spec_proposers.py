"""Proposers and the choice of K, without a model: n-gram lookup, the suffix index (shared
only under one cache salt, bounded), the batch-size table and dynamic K from acceptance and
step cost, and the configuration's refusals."""

import numpy as np
import pytest

from stillcut.engine.config import SpeculativeConfig, parse_k_per_batch
from stillcut.engine.request import Request
from stillcut.engine.spec_decode.ngram import NgramProposer, lookup
from stillcut.engine.spec_decode.policy import SpeculationPolicy
from stillcut.engine.spec_decode.suffix import SuffixIndex, SuffixProposer


def _request(request_id, prompt, output=(), salt=None) -> Request:
    request = Request(request_id, list(prompt), cache_salt=salt)
    request.output_token_ids.extend(output)
    return request


def test_ngram_proposes_what_followed_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert lookup(tokens, 2, 3, 4) == [7, 8, 5, 2]  # "2 3" last seen before 7
    assert lookup(tokens, 3, 3, 2) == []  # "5 2 3" never occurred before
    proposer = NgramProposer(1, 2)
    request = _request("a", [4, 5, 6, 4], output=[5])
    assert proposer.propose([request, request], [2, 0]) == [[6, 4], []]


def test_suffix_proposes_a_phrase_of_an_earlier_answer_under_the_same_salt_only():
    proposer = SuffixProposer(2, 4)
    first = _request("a", [10, 11, 12], output=[20, 21, 22, 23, 24], salt="tenant-1")
    proposer.propose([first], [3])
    proposer.finish(first)
    again = _request("b", [30, 11, 12], output=[20, 21], salt="tenant-1")
    other = _request("c", [30, 11, 12], output=[20, 21], salt="tenant-2")
    assert proposer.propose([again, other], [3, 3]) == [[22, 23, 24], []]
    opening = _request("d", [30, 11, 12], salt="tenant-1")  # the answer's start, from the prompt
    opening.output_token_ids.append(20)
    assert proposer.propose([opening], [2]) == [[21, 22]]


def test_suffix_index_memory_is_bounded():
    index = SuffixIndex(1, 2, max_stored_tokens=10)
    for start in range(0, 40, 5):
        index.add(list(range(start, start + 5)))
    assert index.num_stored_tokens <= 10 and len(index.sequences) == 2
    assert index.find([1, 2], 2) is None  # evicted with its sequence
    assert index.find([36, 37], 2) is not None
    assert len(index.ends) == 2 * (2 * 5 - 1)  # only the kept sequences' n-grams


def test_k_per_batch_table():
    config = SpeculativeConfig(
        num_speculative_tokens=4, k_per_batch=parse_k_per_batch("1:4,8:2,32:0")
    )
    assert [config.k_for_batch(b) for b in (1, 7, 8, 31, 32, 100)] == [4, 4, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="BATCH:K"):
        parse_k_per_batch("1=4")
    with pytest.raises(ValueError, match="each K must be in"):
        SpeculativeConfig(num_speculative_tokens=2, k_per_batch=((1, 4),))


def test_dynamic_k_follows_acceptance_and_cost():
    config = SpeculativeConfig(num_speculative_tokens=4)
    policy = SpeculationPolicy(config, step_cost=lambda batch, k: 1.0 + 0.1 * k * batch)
    good, bad = _request("good", [1]), _request("bad", [1])
    for _ in range(30):
        policy.observe(good, 4, 4)
        policy.observe(bad, 4, 0)
    assert policy.num_tokens([good]) == [4]
    assert policy.num_tokens([bad]) == [0]  # speculation would only cost
    assert policy.num_tokens([good] * 64) == [0] * 64  # verifying is no longer cheap
    # one K for the step, by the tokens of all its requests: 5.9 tokens for 2 x 1.8 at K = 4
    assert policy.num_tokens([good, bad]) == [4, 4]
    assert policy.num_tokens([good, bad, bad, bad]) == [0] * 4  # 5.1 for 4 x 1.4 at best
    pinned = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=4, dynamic=False))
    assert pinned.num_tokens([bad] * 64) == [4] * 64


def test_calibration_measures_every_k_and_a_drafts_proposals(tiny_checkpoint, monkeypatch):
    """A dynamic engine measures its verify steps at start-up, each K itself (the cost is not
    linear in K), with a draft model's decode steps added for its proposals; lookups take the
    largest measured batch size not above the batch."""
    from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stillcut.engine.llm_engine import LLMEngine
    from stillcut.engine.spec_decode import calibration
    from stillcut.engine.spec_decode.calibration import StepCosts, measure_step_costs

    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256),
        cache=CacheConfig(num_blocks=64),
        speculative=SpeculativeConfig(num_speculative_tokens=3),
    )
    engine = LLMEngine(tiny_checkpoint, config)
    costs = engine.speculator.policy.step_cost
    assert isinstance(costs, StepCosts) and costs.sizes == [1, 4]
    assert all(len(row) == 4 and row[0] == 1.0 and min(row) > 0 for row in costs.costs.values())
    assert costs(7, 2) == costs.costs[4][2] and costs(1, 3) == costs.costs[1][3]
    # a calibration step samples its tokens as a verify step whose drafts are all accepted
    from stillcut.engine.row_sampler import RowSampler

    sampled, sample = [], RowSampler.sample

    def recording(*args, **kwargs):
        result = sample(*args, **kwargs)
        sampled.append(result[0])
        return result

    monkeypatch.setattr(RowSampler, "sample", recording)
    calibration.time_verify_step(engine.runner, 2, 4, 5)
    assert sampled and all(list(map(len, tokens)) == [4, 4] for tokens in sampled)
    # the arithmetic, on made-up step times: a target step of w tokens takes w, a draft step 0.5
    draft_runner = object()
    monkeypatch.setattr(
        calibration,
        "time_verify_step",
        lambda runner, batch, width, blocks, runs: 0.5 if runner is draft_runner else float(width),
    )
    with_draft = measure_step_costs(engine.runner, 1, 3, draft_runner=draft_runner)
    assert with_draft.costs == {1: (1.0, 2.5, 4.0, 5.5)}  # (1 + k) + k x 0.5


def test_calibration_takes_each_k_from_interleaved_rounds_never_below_fewer_drafts(
    tiny_checkpoint, monkeypatch
):
    """Each width is timed once per round, the rounds interleaved; a k's cost is the median of
    its rounds' ratios to their plain step (a round slowed down whole changes no ratio, one
    slow reading is outvoted), and never below the cost of fewer drafts: a reading that makes
    more drafts cheaper (noise) would otherwise keep a request that is never accepted
    speculating."""
    from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stillcut.engine.llm_engine import LLMEngine
    from stillcut.engine.spec_decode import calibration
    from stillcut.engine.spec_decode.calibration import measure_step_costs

    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=256),
        cache=CacheConfig(num_blocks=64),
    )
    engine = LLMEngine(tiny_checkpoint, config)
    readings = iter(
        [
            # round 1: plain, k = 1, 2, 3
            1.0, 1.2, 1.1, 1.5,
            # round 2, the machine twice as slow: the same ratios
            2.0, 2.4, 2.2, 3.0,
            # round 3: one slow reading of k = 1
            1.0, 9.0, 1.1, 1.5,
        ]
    )  # fmt: skip
    widths = []

    def reading(runner, batch, width, blocks, runs):
        widths.append(width)
        return next(readings)

    monkeypatch.setattr(calibration, "time_verify_step", reading)
    costs = measure_step_costs(engine.runner, 1, 3)
    assert widths == [1, 2, 3, 4] * calibration.NUM_ROUNDS
    assert costs.costs == {1: (1.0, 1.2, 1.2, 1.5)}  # k = 2 read 1.1: not below k = 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft"}, "draft_model"),
        ({"method": "ngram", "draft_model": "x"}, "draft_model"),
        ({"method": "eagle"}, "method"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ],
)
def test_bad_speculative_config_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields)


def test_scheduler_rolls_back_rejected_drafts_and_hashes_only_accepted_blocks():
    from stillcut.engine.config import CacheConfig, SchedulerConfig
    from stillcut.engine.kv_cache import block_extra_keys, hash_block
    from stillcut.engine.request import SamplingParams
    from stillcut.engine.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4), 16)
    request = Request("r", [1, 2, 3], sampling_params=SamplingParams(max_tokens=20))
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), {"r": [10]})
    request.spec_token_ids = [11, 12, 13]
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"r": 4} and step.spec_token_ids == {"r": [11, 12, 13]}
    (update,) = scheduler.update_from_output(step, {"r": [11, 99]})  # 12 rejected, 99 instead
    assert update.new_token_ids == [11, 99] and request.num_computed_tokens == 5
    pool = scheduler.kv_cache.block_pool
    first = hash_block(None, [1, 2, 3, 10], block_extra_keys(request, 0, 4))
    # block 1 held the rejected 12 and 13 at positions 5-6: not hashed until they are replaced
    assert [b.block_hash for b in pool.blocks if b.block_hash] == [first]
    request.spec_token_ids = [5, 6]
    scheduler.update_from_output(scheduler.schedule(), {"r": [5, 6, 7]})  # all accepted
    second = hash_block(first, [11, 99, 5, 6], block_extra_keys(request, 1, 4))
    assert pool.lookup(second) is not None and request.num_computed_tokens == 8
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (5, 3)
    scheduler.abort("r")
    assert scheduler.kv_cache.num_free_blocks == 16
