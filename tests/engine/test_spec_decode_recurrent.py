"""Speculative decoding on hybrid models, whose recurrent states must be rolled back past
rejected drafts: Qwen3.5 (Gated DeltaNet) and Nemotron 3 Nano Omni (Mamba2).

A verify step advances a request's recurrent states one scored token at a time and keeps the
states after each; at its next step the runner restores those after its last accepted token.
On tiny random checkpoints and a prompt that holds the start of its own greedy answer (so the
n-gram proposer fires, and is right some of the time): the greedy output equals decoding
without speculation (logprobs within 1e-4), some drafts are accepted and some rejected, and
after every rejection the row's states equal those of a run that never drafted at the same
token, within 1e-5. A dynamic K, calibrated at start-up on verify steps of the recurrent
layers, gives the same output.
"""

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.recurrent_rows import RecurrentRows
from stillcut.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=0)


def _engine(path, speculative: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024),
            cache=CacheConfig(num_blocks=128, block_size=16),
            speculative=speculative,
        ),
    )


def _ngram(dynamic: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=3, dynamic=dynamic)


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h_omni"])
def setup(request):
    path = cached_checkpoint("tiny", seed=0, family=request.param)
    plain = _engine(path)
    question = list(range(300, 340))
    answer = plain.generate([question], GREEDY)[0].token_ids
    # the question again after the start of its answer: the answer tends to follow again
    prompt = [*question, *answer[:10], *question]
    return request.param, path, plain, prompt


def _states_by_computed_tokens(engine: LLMEngine, monkeypatch) -> dict[int, list[torch.Tensor]]:
    """Records, at the start of each of `engine`'s steps (after any rollback), the recurrent
    states of every request it runs on, by its number of computed tokens."""
    recorded: dict[int, list[torch.Tensor]] = {}
    runner = engine.runner
    update_rows = runner._update_rows

    def update_and_record(output):
        update_rows(output)
        for cached in output.scheduled_cached:
            row = runner.rows[cached.request_id].row
            states = [t[row].clone() for layer in runner.recurrent_states.values() for t in layer]
            recorded[cached.num_computed_tokens] = states

    monkeypatch.setattr(runner, "_update_rows", update_and_record)
    return recorded


def test_greedy_output_equals_no_speculation_and_rejected_drafts_roll_the_state_back(
    setup, monkeypatch
):
    _, path, plain, prompt = setup
    plain_states = _states_by_computed_tokens(plain, monkeypatch)
    (expected,) = plain.generate([prompt], GREEDY)
    engine = _engine(path, _ngram())
    spec_states = _states_by_computed_tokens(engine, monkeypatch)
    rolled_back = []
    roll_back = RecurrentRows.roll_back

    def recording_roll_back(recurrent, request_id, row, num_computed):
        start = recurrent.verified.get(request_id)
        if start is not None and num_computed != start + recurrent.draft_stride:
            rolled_back.append(num_computed)  # a draft was rejected
        roll_back(recurrent, request_id, row, num_computed)

    monkeypatch.setattr(RecurrentRows, "roll_back", recording_roll_back)
    (ours,) = engine.generate([prompt], GREEDY)
    assert ours.token_ids == expected.token_ids
    sampled = [[logprob for *_, logprob in o.logprobs] for o in (ours, expected)]
    assert sampled[0] == pytest.approx(sampled[1], abs=1e-4)
    assert 0 < ours.metrics.num_accepted_tokens < ours.metrics.num_draft_tokens
    assert rolled_back
    for num_computed in rolled_back:
        for ours_state, theirs in zip(
            spec_states[num_computed], plain_states[num_computed], strict=True
        ):
            torch.testing.assert_close(ours_state, theirs, atol=1e-5, rtol=1e-5)
    engine.step()  # drops the finished row
    assert not engine.runner.recurrent.verified and not engine.runner.rows


def test_a_dynamic_k_calibrated_on_recurrent_verify_steps_gives_the_same_output(setup):
    family, path, plain, prompt = setup
    if family != "qwen3_5":
        pytest.skip("the calibration's recurrent path is the same for both families")
    (expected,) = plain.generate([prompt], GREEDY)
    engine = _engine(path, _ngram(dynamic=True))
    (ours,) = engine.generate([prompt], GREEDY)
    assert ours.token_ids == expected.token_ids
