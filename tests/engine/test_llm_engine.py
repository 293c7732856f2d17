"""LLMEngine's outputs: why a request finished, and seeded sampling whatever shares the batch."""

from contextlib import contextmanager

import pytest

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine, StepFailed
from stillcut.engine.outputs import Snapshot
from stillcut.engine.request import SamplingParams

BLOCK = 16


def _engine(path, num_blocks: int = 256, budget: int = 512) -> LLMEngine:
    return LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=1024),
            cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK, held_share=0.0),
        ),
    )


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return _engine(tiny_checkpoint)


@contextmanager
def _always_says(engine: LLMEngine, token_id: int):
    """Make the model's greedy choice `token_id` at every step."""
    compute_logits = engine.model.compute_logits

    def forced(hidden):
        logits = compute_logits(hidden)
        logits[:, token_id] = logits.max() + 10.0
        return logits

    engine.model.compute_logits = forced
    try:
        yield
    finally:
        del engine.model.compute_logits


def test_finish_and_stop_reasons_follow_the_openai_convention(engine):
    """EOS (any of the checkpoint's eos ids) stops with stop_reason None; a stop token id or
    a stop string is the stop_reason; running out of tokens is "length"."""
    eos_ids = engine.eos_token_ids
    assert len(eos_ids) == 2  # <|im_end|>, and <|endoftext|> from generation_config.json
    prompt = [9, 8, 7]
    stop_id = 300
    text = engine.processor.tokenizer.decode([stop_id])
    cases = {
        (eos_ids[0], SamplingParams(max_tokens=4)): ("stop", None),
        (eos_ids[1], SamplingParams(max_tokens=4)): ("stop", None),
        (eos_ids[0], SamplingParams(max_tokens=4, ignore_eos=True)): ("length", None),
        (stop_id, SamplingParams(max_tokens=4, stop_token_ids=(stop_id,))): ("stop", stop_id),
        (stop_id, SamplingParams(max_tokens=4, stop=(text,))): ("stop", text),
        (stop_id, SamplingParams(max_tokens=2)): ("length", None),
    }
    for (token_id, params), expected in cases.items():
        with _always_says(engine, token_id):
            (output,) = engine.generate([prompt], params)
        assert (output.finish_reason, output.stop_reason) == expected, (token_id, params)


SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
# greedy, the tiny model would repeat its last token: the penalty makes every token another
PENALIZED = SamplingParams(max_tokens=24, repetition_penalty=1.5, frequency_penalty=0.5)


@pytest.mark.parametrize("seeded", [SEEDED, PENALIZED], ids=["seeded", "penalized"])
def test_a_request_samples_the_same_alone_batched_and_preempted(tiny_checkpoint, seeded):
    """A seeded request draws from its own generator, a penalized one counts its own tokens:
    other rows in the batch, prompts computed in other chunks, and a preemption (its outputs
    recomputed as prompt, its counts kept) change nothing."""
    prompt = list(range(200, 260))
    (alone,) = _engine(tiny_checkpoint).generate([prompt], seeded)
    others = [
        (list(range(300, 340)), SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)),
        (list(range(400, 470)), SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3)),
        (
            list(range(600, 620)),
            SamplingParams(max_tokens=30, temperature=1.2, top_k=50, min_p=0.01, seed=7),
        ),
        (list(range(700, 720)), SamplingParams(max_tokens=30, repetition_penalty=1.3)),
        (list(range(500, 530)), SamplingParams(max_tokens=30, temperature=0.7, seed=1234)),
    ]
    # last: the newest running request is the one preempted
    prompts, params = [*(p for p, _ in others), prompt], [*(s for _, s in others), seeded]
    batched = _engine(tiny_checkpoint, budget=48).generate(prompts, params)[-1]
    tight = _engine(tiny_checkpoint, num_blocks=10, budget=48)  # 160 tokens for 6 requests
    preempted = _record_preemptions(tight)
    after_preemption = tight.generate(prompts, params)[-1]
    assert after_preemption.request_id in preempted
    assert len(set(alone.token_ids)) > 20  # not one token over and over
    assert batched.token_ids == alone.token_ids
    assert after_preemption.token_ids == alone.token_ids


def _record_preemptions(engine: LLMEngine) -> list[str]:
    """The ids of the requests the engine's scheduler preempts from now on, in order."""
    preempted = []
    preempt = engine.scheduler._preempt

    def recording(request):
        preempted.append(request.request_id)
        preempt(request)

    engine.scheduler._preempt = recording
    return preempted


def test_each_output_keeps_what_it_held_when_it_was_made(engine):
    """Outputs share the request's growing lists (so building one costs the same at any
    length); an earlier one must not show tokens, logprobs or text that came later."""
    params = SamplingParams(max_tokens=8, logprobs=2, repetition_penalty=1.5, ignore_eos=True)
    engine.add_request([9, 8, 7], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    deltas = ""
    for count, output in enumerate(outputs, start=1):
        deltas += output.delta
        assert len(output.token_ids) == len(output.logprobs) == count
        assert output.token_ids[-1:] == output.new_token_ids
        assert output.text == deltas
    final = outputs[-1]
    assert final.token_ids == list(final.token_ids) and final.token_ids == tuple(final.token_ids)
    assert (
        final.token_ids[2:4] == list(final.token_ids)[2:4]
        and final.token_ids[-8] == final.token_ids[0]
    )


def test_snapshot_reads_only_what_the_list_held():
    items = [1, 2, 3]
    snapshot = Snapshot(items)
    items.append(4)
    assert len(snapshot) == 3 and list(snapshot) == [1, 2, 3] == snapshot
    assert snapshot[-1] == 3 and snapshot[1:] == [2, 3] and snapshot[::-1] == [3, 2, 1]
    assert snapshot != [1, 2, 3, 4] and Snapshot(items) == (1, 2, 3, 4)
    with pytest.raises(IndexError, match="index 3 out of range for 3 items"):
        snapshot[3]


@contextmanager
def _next_logits_raise(engine: LLMEngine):
    """The next step that samples raises, as sampling a request the sampler cannot take would."""
    compute_logits = engine.model.compute_logits

    def fails_once(hidden):
        del engine.model.compute_logits
        raise RuntimeError("planted: Overflow when unpacking long long")

    engine.model.compute_logits = fails_once
    try:
        yield
    finally:
        engine.model.__dict__.pop("compute_logits", None)
        assert engine.model.compute_logits == compute_logits


def test_a_failed_step_aborts_its_requests_and_the_engine_goes_on(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [list(range(100, 140)), list(range(300, 321))]
    expected = [out.token_ids for out in engine.generate(prompts, params)]
    num_rows = len(engine.runner.free_rows)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    with _next_logits_raise(engine), pytest.raises(StepFailed) as failed:
        engine.step()
    assert set(failed.value.request_ids) == set(ids)
    assert "Overflow" not in str(failed.value)  # the cause is chained, not shown
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    kv = engine.scheduler.kv_cache
    kv.check_consistency()
    assert kv.num_free_blocks == kv.num_blocks
    assert [out.token_ids for out in engine.generate(prompts, params)] == expected
    assert len(engine.runner.free_rows) == num_rows  # the failed step's rows were dropped
