"""The asyncio front of the engine: same outputs as stepping it directly, a bounded admission
queue, cancellation that frees blocks, held prefixes, errors that reach the caller, and a
shutdown that finishes or aborts in-flight work."""

import asyncio
import threading

import pytest

from stillcut.engine.admission import RequestTooLong
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine, StepFailed
from stillcut.engine.request import SamplingParams
from stillcut.service.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestAborted

from .conftest import plant_step_failure

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_engine(tiny_checkpoint):
    return LLMEngine(
        tiny_checkpoint,
        EngineConfig(
            scheduler=SchedulerConfig(max_model_len=2048),
            cache=CacheConfig(num_blocks=256, block_size=16),
        ),
    )


@pytest.fixture
def engine(llm_engine):
    engine = AsyncEngine(llm_engine, max_queue=3)
    yield engine
    engine.shutdown(graceful=False)


def _prompt(engine, text):
    return engine.engine.processor.build_text(text)


def _assert_idle_and_free(llm_engine):
    kv = llm_engine.scheduler.kv_cache
    kv.check_consistency()
    assert not llm_engine.scheduler.requests
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


async def _collect(stream):
    return [output async for output in stream]


def test_outputs_equal_the_engine_stepped_directly(engine, llm_engine):
    prompts = [_prompt(engine, f"Question {k}?") for k in range(3)]

    async def run():
        return await asyncio.gather(*(_collect(engine.generate(p, GREEDY)) for p in prompts))

    streams = asyncio.run(run())
    engine.shutdown()  # the thread is joined: the engine may be stepped here again
    expected = llm_engine.generate(prompts, GREEDY)
    for outputs, reference in zip(streams, expected, strict=True):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].token_ids == reference.token_ids
        assert "".join(o.delta for o in outputs) == reference.text
    _assert_idle_and_free(llm_engine)


def test_a_full_queue_raises_queue_full(engine, llm_engine):
    release = threading.Event()

    async def run():
        blocked = asyncio.ensure_future(engine.call(lambda _: release.wait()))
        await asyncio.sleep(0.05)  # the engine thread is now busy: adds stay in transit
        admitted = [
            asyncio.ensure_future(_collect(engine.generate(_prompt(engine, str(k)), GREEDY)))
            for k in range(engine.max_queue)
        ]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull):
            await _collect(engine.generate(_prompt(engine, "one too many"), GREEDY))
        assert engine.queue_depth == engine.max_queue
        release.set()
        await blocked
        return await asyncio.gather(*admitted)

    outputs = asyncio.run(run())
    assert all(o[-1].finish_reason == "length" for o in outputs)
    asyncio.run(engine.call(_assert_idle_and_free))


def test_leaving_the_stream_aborts_the_request(engine):
    async def run():
        stream = engine.generate(_prompt(engine, "Go on."), LONG)
        async for output in stream:
            if len(output.token_ids) >= 3:
                break
        await stream.aclose()
        task = asyncio.ensure_future(_collect(engine.generate(_prompt(engine, "More."), LONG)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.call(lambda _: None)  # the aborts were posted before this call

    asyncio.run(run())
    asyncio.run(engine.call(_assert_idle_and_free))


def test_admission_and_call_errors_reach_the_caller(engine):
    too_long = SamplingParams(max_tokens=4000)

    async def run():
        with pytest.raises(RequestTooLong):
            await _collect(engine.generate(_prompt(engine, "x"), too_long))
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda _: 1 / 0)
        return await _collect(engine.generate(_prompt(engine, "still fine"), GREEDY))

    assert asyncio.run(run())[-1].finished


def test_held_prefix_is_extended_and_released(engine):
    processor = engine.engine.processor

    async def run():
        prefix = _prompt(engine, "A long shared beginning " * 4)
        held = await _collect(engine.generate(prefix, GREEDY, request_id="held", hold=True))
        assert [o.finish_reason for o in held] == ["held"]
        extended = await engine.extend_held("held", processor.encode(" and more words"))
        assert extended.finish_reason == "held"
        used = await engine.call(lambda e: e.scheduler.kv_cache.num_free_blocks)
        await engine.call(lambda e: e.release_held("held"))
        free = await engine.call(lambda e: e.scheduler.kv_cache.num_free_blocks)
        assert free > used

    asyncio.run(run())
    asyncio.run(engine.call(_assert_idle_and_free))


def test_graceful_shutdown_finishes_and_hard_shutdown_aborts(llm_engine):
    async def run(graceful, params):
        engine = AsyncEngine(llm_engine)
        task = asyncio.ensure_future(_collect(engine.generate(_prompt(engine, "x"), params)))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.shutdown, graceful=graceful, timeout=30)
        with pytest.raises(EngineStopped):
            await _collect(engine.generate(_prompt(engine, "y"), GREEDY))
        return await asyncio.gather(task, return_exceptions=True)

    (finished,) = asyncio.run(run(graceful=True, params=GREEDY))
    assert finished[-1].finish_reason == "length"
    (aborted,) = asyncio.run(run(graceful=False, params=LONG))
    assert isinstance(aborted, EngineStopped)
    _assert_idle_and_free(llm_engine)


def test_abort_ends_a_reader_still_waiting(engine, llm_engine):
    """`abort` from elsewhere must end the iteration of whoever still reads that request."""

    async def run():
        stream = engine.generate(_prompt(engine, "Go on."), LONG, request_id="to-abort")
        first = await stream.__anext__()
        assert not first.finished
        await engine.abort("to-abort")
        with pytest.raises(RequestAborted):
            async for _ in stream:
                pass

    asyncio.run(asyncio.wait_for(run(), timeout=60))
    engine.shutdown()
    _assert_idle_and_free(llm_engine)


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(engine, llm_engine):
    async def run():
        expected = await _collect(engine.generate(_prompt(engine, "Again?"), GREEDY))
        await engine.call(plant_step_failure)
        with pytest.raises(StepFailed):
            await _collect(engine.generate(_prompt(engine, "Again?"), GREEDY))
        assert engine.is_running
        again = await _collect(engine.generate(_prompt(engine, "Again?"), GREEDY))
        assert again[-1].token_ids == expected[-1].token_ids
        await engine.call(_assert_idle_and_free)

    asyncio.run(asyncio.wait_for(run(), timeout=60))


def test_a_fault_in_the_engine_state_stops_the_loop(llm_engine):
    engine = AsyncEngine(llm_engine)

    async def run():
        await engine.call(lambda e: plant_step_failure(e, AssertionError))
        with pytest.raises(EngineStopped):
            await _collect(engine.generate(_prompt(engine, "x"), GREEDY))

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert not engine.is_running
    finally:
        engine.shutdown(graceful=False)
        for request_id in list(llm_engine.scheduler.requests):  # the dead loop left it
            llm_engine.abort(request_id)
