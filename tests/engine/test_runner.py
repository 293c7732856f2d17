"""The runner's persistent rows: how many there are, and what a reused row holds."""

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import RequestStatus, SamplingParams

BLOCK = 16


def _engine(path, max_num_seqs: int, num_blocks: int = 64, max_num_held_seqs=16) -> LLMEngine:
    return LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(
                max_num_batched_tokens=64,
                max_num_seqs=max_num_seqs,
                max_num_held_seqs=max_num_held_seqs,
                max_model_len=512,
            ),
            cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK, held_share=0.25),
        ),
    )


def _assert_rows_padded_with_zeros(engine: LLMEngine) -> None:
    """Past its blocks, each live row of the block table is zero (attention reads padding)."""
    runner = engine.runner
    for state in runner.rows.values():
        padding = runner.block_table[state.row, len(state.block_ids) :]
        assert not padding.any(), f"row {state.row} pads with {padding.unique().tolist()}"


def test_a_reused_row_is_padded_with_zeros(tiny_checkpoint):
    engine = _engine(tiny_checkpoint, max_num_seqs=1)
    long = list(range(1000, 1000 + 6 * BLOCK))
    engine.generate([long], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        _assert_rows_padded_with_zeros(engine)


def test_rows_are_as_many_as_requests_can_run(tiny_checkpoint):
    """Rows of finished, aborted and preempted requests go before new ones come, and a live
    request keeps one of the `max_num_held_seqs` rows of its own, so `max_num_seqs +
    max_num_held_seqs` rows serve any churn: here arrivals, an abort, preemption (the pool
    holds about two requests) and a held prefix extended between steps."""
    engine = _engine(tiny_checkpoint, max_num_seqs=2, num_blocks=12, max_num_held_seqs=1)
    runner = engine.runner
    assert runner.block_table.shape[0] == runner.token_ids.shape[0] == 3
    preempted = []
    preempt = engine.scheduler._preempt

    def recording(request):
        preempted.append(request.request_id)
        preempt(request)

    engine.scheduler._preempt = recording
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(list(range(100 + 9 * k, 160 + 9 * k)), params) for k in range(4)]
    held = engine.add_request(list(range(7, 30)), hold=True)
    finished, extended = set(), False
    for step in range(1000):
        if not engine.has_unfinished_requests():
            break
        if step == 3:
            engine.abort(ids[1])
        if step == 6:
            ids.append(engine.add_request([1, 2, 3], SamplingParams(max_tokens=5)))
        if engine.scheduler.requests[held].status is RequestStatus.HELD and not extended:
            engine.append_input(held, [40, 41, 42])  # re-enters while others hold the rows
            extended = True
        finished |= {o.request_id for o in engine.step() if o.finished and o.request_id != held}
        assert len(runner.rows) <= 3
        _assert_rows_padded_with_zeros(engine)
    assert extended and preempted and finished == {ids[0], *ids[2:]}
    engine.release_held(held)
    engine.step()
    assert not runner.rows and sorted(runner.free_rows) == [0, 1, 2]
    assert engine.scheduler.kv_cache.num_free_blocks == 12
