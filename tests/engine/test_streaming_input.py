"""Streaming-input requests: input appended to a live request reaches the runner as its new
tokens only, and the request then computes exactly what a fresh request over the whole
sequence computes: on Qwen2.5-VL, and on Qwen3.5, whose Gated DeltaNet states stay in the
held request's runner row from one append to the next.

Each tubelet is its own one-tubelet video between text, as narration writes it, so the
positions a generated token took when it was decoded equal those a fresh prompt gives it.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import RequestStatus, SamplingParams
from stillcut.vision.pipeline import VisionPipeline

SEGMENT = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=5)
LOGPROB_ATOL = 1e-5


def _engine(path, speculative: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048),
            cache=CacheConfig(num_blocks=256, block_size=16, held_share=0.5),
            speculative=speculative,
        ),
    )


def _tubelets(path) -> list:
    pipeline = VisionPipeline(path)
    rng = np.random.default_rng(7)
    frames = rng.integers(0, 256, (2, 56, 84, 3), dtype=np.uint8)
    item = pipeline.video(frames, frames_fps=2.0)
    return [
        replace(item, identifier=f"tubelet-{k}", embeds=item.embeds * (1 + k)) for k in range(6)
    ]


@pytest.fixture(scope="module")
def tubelets(tiny_checkpoint):
    return _tubelets(tiny_checkpoint)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_5"])
def streamed(request, tiny_checkpoint):
    """A checkpoint and six tubelets of it: the tiny Qwen2.5-VL one, and a tiny Qwen3.5."""
    if request.param == "qwen2_5_vl":
        return tiny_checkpoint, _tubelets(tiny_checkpoint)
    path = cached_checkpoint("tiny", seed=1, family=request.param)
    return path, _tubelets(path)


def _appended_input(engine, k, item) -> list[int]:
    special = engine.processor.special
    text = engine.processor.encode(f"<{k}.0s>")
    pads = [special.video_token_id] * item.num_tokens
    return [*text, special.vision_start_token_id, *pads, special.vision_end_token_id]


def _run_segment(engine, request_id) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_appends_cost_their_new_tokens_and_match_a_fresh_request(streamed):
    checkpoint, tubelets = streamed
    engine = _engine(checkpoint)
    placed_sizes, rows_added = [], []
    extend_positions, add_row = engine.model.extend_positions, engine.runner._add_row
    engine.model.extend_positions = lambda c, ids, *a: (
        placed_sizes.append(len(ids)) or (extend_positions(c, ids, *a))
    )
    engine.runner._add_row = lambda new: rows_added.append(new.request_id) or add_row(new)

    prompt = engine.processor.build_text("Narrate what you see.")
    request_id = engine.add_request(prompt, SEGMENT, streaming=True)
    sequence, items = list(prompt.token_ids), []
    segments = [_run_segment(engine, request_id)]
    for k, item in enumerate(tubelets):
        request = engine.scheduler.requests[request_id]
        assert request.status is RequestStatus.HELD and segments[-1][-1].segment_end == "length"
        sequence += request.output_token_ids
        new_ids = _appended_input(engine, k, item)
        placed_sizes.clear()
        engine.append_input(request_id, new_ids, [item])
        sequence += new_ids
        items.append(item)
        segments.append(_run_segment(engine, request_id))
        # the runner placed the new tokens alone, into the row it kept
        assert placed_sizes == [len(new_ids)] and rows_added == [request_id]
    last = segments[-1][-1]
    # each append computed its tokens and the segment's last sampled token, nothing more
    assert last.metrics.append_prefill_tokens == [
        len(_appended_input(engine, k, item)) + 1 for k, item in enumerate(tubelets)
    ]

    # the last segment is what a fresh request over the whole sequence generates
    fresh = _engine(checkpoint)
    reference_id = fresh.add_request(sequence, SEGMENT, mm_items=items)
    (reference,) = [o for o in _run_segment(fresh, reference_id) if o.finished]
    assert list(last.token_ids) == list(reference.token_ids)
    for (ids, ours, _), (ref_ids, theirs, _) in zip(
        last.logprobs[-3:], reference.logprobs, strict=True
    ):
        assert ids == ref_ids
        assert np.allclose(ours, theirs, atol=LOGPROB_ATOL)
    # the row's positions, placed append by append, are those of the whole sequence at once
    row = engine.runner.rows[request_id]
    whole = fresh.model.prompt_positions(torch.tensor(sequence), items).positions
    assert torch.equal(row.positions[:, : row.prompt_len], whole)
    engine.abort(request_id)
    engine.step()
    assert not engine.runner.rows
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_blocks


def test_input_appended_while_decoding_joins_the_running_request(streamed):
    """A tubelet appended mid-segment: the tokens sampled so far stay, the input follows
    them in the next step (beside the other request's decode), and generation goes on as a
    fresh request over the whole sequence would."""
    checkpoint, tubelets = streamed
    engine = _engine(checkpoint)
    params = replace(SEGMENT, max_tokens=6)
    prompt = engine.processor.build_text("Narrate what you see.")
    request_id = engine.add_request(prompt, params, streaming=True)
    other = engine.add_request(engine.processor.build_text("Something else."), params)
    for _ in range(3):
        engine.step()
    request = engine.scheduler.requests[request_id]
    assert request.status is RequestStatus.RUNNING and len(request.output_token_ids) == 3
    sequence = [*request.prompt_token_ids, *request.output_token_ids]
    new_ids = _appended_input(engine, 0, tubelets[0])
    engine.append_input(request_id, new_ids, [tubelets[0]])
    scheduled = engine.scheduler.schedule()
    # the sampled token not yet computed, then the input, in a step with the other's decode
    assert scheduled.num_scheduled_tokens == {other: 1, request_id: len(new_ids) + 1}
    result = engine.runner.execute(scheduled)
    engine.scheduler.update_from_output(scheduled, result.sampled)
    outputs = _run_segment(engine, request_id)
    fresh = _engine(checkpoint)
    reference_id = fresh.add_request([*sequence, *new_ids], params, mm_items=[tubelets[0]])
    (reference,) = [o for o in _run_segment(fresh, reference_id) if o.finished]
    assert list(outputs[-1].token_ids) == list(reference.token_ids)
    assert outputs[-1].segment_end == "length"
    engine.abort(request_id)


def test_a_speculating_request_proposes_no_drafts_until_its_appended_input_is_in(
    tiny_checkpoint, tubelets
):
    """Drafts guess what follows the tokens so far: with input waiting to be appended they
    would guess what comes before it, so none are verified until the input is computed and
    the request samples again; then speculation resumes, and the tokens are exact."""
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, dynamic=False)
    engine = _engine(tiny_checkpoint, speculative)
    params = replace(SEGMENT, max_tokens=12, logprobs=None)
    prompt = engine.processor.build_text("Narrate what you see.")
    request_id = engine.add_request(prompt, params, streaming=True)
    schedule, steps = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    while not any(request_id in step.spec_token_ids for step in steps):
        engine.step()  # the tiny model repeats its last token: n-grams propose
    request = engine.scheduler.requests[request_id]
    assert request.status is RequestStatus.RUNNING and request.spec_token_ids
    sequence = [*request.prompt_token_ids, *request.output_token_ids]
    new_ids = _appended_input(engine, 0, tubelets[0])
    engine.append_input(request_id, new_ids, [tubelets[0]])
    steps.clear()
    engine.step()
    assert steps[0].num_scheduled_tokens[request_id] == len(new_ids) + 1
    assert request_id not in steps[0].spec_token_ids
    outputs = _run_segment(engine, request_id)
    assert any(request_id in step.spec_token_ids for step in steps[1:])  # speculating again
    fresh = _engine(tiny_checkpoint)
    reference_id = fresh.add_request([*sequence, *new_ids], params, mm_items=[tubelets[0]])
    (reference,) = [o for o in _run_segment(fresh, reference_id) if o.finished]
    assert list(outputs[-1].token_ids) == list(reference.token_ids)
    engine.abort(request_id)
    engine.step()
    assert engine.scheduler.kv_cache.num_free_blocks == engine.scheduler.kv_cache.num_blocks


@pytest.mark.parametrize("ending", ["stop token", "eos"])
def test_a_segment_ends_at_a_stop_token_kept_or_an_eos_dropped(tiny_checkpoint, tubelets, ending):
    """The tiny model repeats its last input token, here the vision end marker: made a stop
    token it ends each segment and stays in the sequence; made EOS it ends each segment and
    is not written, so the next input follows the segment's other tokens."""
    engine = _engine(tiny_checkpoint)
    vision_end = engine.processor.special.vision_end_token_id
    params = replace(SEGMENT, ignore_eos=False)
    if ending == "stop token":
        params = replace(params, stop_token_ids=(vision_end,))
    else:
        engine.eos_token_ids = (vision_end,)
    prompt = engine.processor.narration_prompt("Narrate.", tubelets[0], 0.0)
    request_id = engine.add_request(prompt, params, streaming=True)
    for k, item in enumerate(tubelets[:3]):
        if k:
            engine.append_input(request_id, engine.processor.narration_input(item, k), [item])
        (last,) = [o for o in _run_segment(engine, request_id) if o.segment_end]
        request = engine.scheduler.requests[request_id]
        assert last.segment_end == "stop" and not last.finished
        kept = [vision_end] if ending == "stop token" else []
        assert request.output_token_ids == kept and list(last.token_ids) == kept
        assert last.stop_reason == (vision_end if ending == "stop token" else None)
    row = engine.runner.rows[request_id]
    sequence = [*request.prompt_token_ids, *request.output_token_ids]
    whole = engine.model.prompt_positions(torch.tensor(sequence), request.mm_items).positions
    assert torch.equal(row.positions[:, : row.prompt_len], whole[:, : row.prompt_len])
    engine.abort(request_id)
