"""Live sessions: streamed frames answer like the whole clip, asks reuse the held prefix, a
pending odd frame is padded for one answer only, empty tubelets extend the video, and closing
frees every block. The answers are checked on Qwen2.5-VL (the stream one video), Qwen3-VL
(each tubelet its own timestamped video) and Qwen3.5 and Qwen3.5-MoE (Qwen3-VL's prompt over a
Gated DeltaNet hybrid: a question forks the held prefix from its recurrent-state snapshot, and
the stream goes on from the held request's own states): their frames are sized so that the
whole-clip pixel budget binds on no clip here, as a stream resizes each tubelet for itself."""

import asyncio
import io
import math
import re
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from PIL import Image

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.processor import PromptError
from stillcut.service.api import VideoLLM
from stillcut.service.async_engine import AsyncEngine
from stillcut.service.live_options import (
    BadFrame,
    LiveLimitExceeded,
    LiveLimits,
    LiveOptions,
    NoFrameYet,
    SessionClosed,
)
from stillcut.service.live_session import LiveSession, decode_frame
from stillcut.vision.pipeline import VideoInput, VisionPipeline

from .conftest import make_llm

BLOCK = 16
FPS = 2.0
# The tiny random model answers the same tokens whatever it sees; its top logprobs tell inputs
# apart (one tubelet more or less moves them by ~1e-3, computing the prompt in other chunks by
# ~1e-6), so answers are compared on both.
OPTIONS = LiveOptions(threshold=0.1, fps=FPS, max_tokens=6, logprobs=5)
LOGPROB_ATOL = 1e-5
TOKENS_PER_TUBELET = 20  # 56x84 frames resize to 112x140: 4 x 5 merged tokens
ENGINE_CONFIG = EngineConfig(
    scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_model_len=2048),
    cache=CacheConfig(num_blocks=256, block_size=BLOCK),
)


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return VisionPipeline(tiny_checkpoint)


@pytest.fixture(scope="module")
def llm_engine(tiny_checkpoint):
    return LLMEngine(tiny_checkpoint, ENGINE_CONFIG)


@pytest.fixture
def engine(llm_engine):
    engine = AsyncEngine(llm_engine)
    yield engine
    engine.shutdown()


@dataclass(frozen=True)
class Family:
    """One family's model for the tests that compare answers with describe_video."""

    pipeline: VisionPipeline
    llm_engine: LLMEngine
    reference_llm: VideoLLM  # on an engine of its own
    frame_size: tuple[int, int]  # (height, width) of the streamed frames
    tokens_per_tubelet: int


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def family(request):
    if request.param == "qwen2_5_vl":
        fixtures = [request.getfixturevalue(n) for n in ("pipeline", "llm_engine", "reference_llm")]
        return Family(*fixtures, (56, 84), TOKENS_PER_TUBELET)
    checkpoint = cached_checkpoint("tiny", seed=1, family=request.param)
    # 96x128 frames stay 96x128 whether a clip has 2 frames or 24: 3 x 4 merged tokens
    return Family(
        VisionPipeline(checkpoint),
        LLMEngine(checkpoint, ENGINE_CONFIG),
        make_llm(checkpoint),
        (96, 128),
        12,
    )


@pytest.fixture
def family_engine(family):
    engine = AsyncEngine(family.llm_engine)
    yield engine
    engine.shutdown()


def _moving_square(
    num_frames: int, static: bool = False, size: tuple[int, int] = (56, 84)
) -> np.ndarray:
    """[T, height, width, 3] uint8: a fixed noisy background and a red square moving 3 px a
    frame."""
    background = np.random.default_rng(7).integers(40, 200, (*size, 3), dtype=np.uint8)
    frames = np.repeat(background[None], num_frames, axis=0)
    for k in range(num_frames):
        x = 0 if static else 3 * k % (size[1] - 16)
        frames[k, 20:36, x : x + 16] = (250, 30, 30)
    return frames


def _png(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()


async def _send(session, frames, first_index=0):
    events = []
    for k, frame in enumerate(frames, start=first_index):
        event = await session.add_frame(k / session.options.fps, _png(frame))
        if event is not None:
            events.append(event)
    return events


async def _final(outputs):
    final = None
    async for output in outputs:
        final = output
    assert final is not None and final.finished
    return final


def _describe(reference_llm, frames, question, options=OPTIONS):
    """describe_video on the frame array (on an engine of its own), and the same prompt's output
    with its top logprobs, which describe does not report."""
    evs, fps = options.evs, options.fps
    result = reference_llm.describe(
        frames, question, evs=evs, max_tokens=options.max_tokens, frames_fps=fps
    )
    (item,) = reference_llm.encode([VideoInput(frames, evs=evs, frames_fps=fps)])  # a cache hit
    prompt = reference_llm.processor.build_text(question, [item])
    (output,) = reference_llm.engine.generate([prompt], options.sampling)
    assert output.token_ids == list(result.token_ids)
    return result, output


async def _ask_matches_describe(session, reference_llm, frames, question, padded=0):
    """The session's answer equals describe_video's on the same frames, and only the question is
    prefilled (plus the held prefix's last partial block and the `padded` tokens of a pending
    odd frame)."""
    answer = await _final(session.ask(question))
    described, expected = _describe(reference_llm, frames, question, session.options)
    assert answer.token_ids == list(described.token_ids) and answer.text == described.text
    assert _logprob_gap(answer, expected) <= LOGPROB_ATOL
    assert answer.metrics.video_tokens_kept == described.evs.tokens_after
    if padded is not None:  # None: no held prefix yet, nothing to reuse
        num_question = len(reference_llm.processor.ask_suffix(question))
        prefilled = answer.metrics.num_prompt_tokens - answer.metrics.num_cached_tokens
        assert prefilled <= num_question + padded + BLOCK
    return answer, described


def _logprob_gap(answer, other) -> float:
    """The largest difference between two answers' top logprobs; inf if their top tokens
    differ."""
    if [ids for ids, _, _ in answer.logprobs] != [ids for ids, _, _ in other.logprobs]:
        return math.inf
    values = [torch.tensor([top for _, top, _ in output.logprobs]) for output in (answer, other)]
    return float((values[0] - values[1]).abs().max())


async def _assert_pool_whole(engine):
    def check(llm_engine):
        kv = llm_engine.scheduler.kv_cache
        kv.check_consistency()
        return not llm_engine.has_unfinished_requests(), [b.ref_cnt for b in kv.block_pool.blocks]

    idle, ref_counts = await engine.call(check)
    assert idle and not any(ref_counts)


def test_answers_equal_describe_on_the_same_frames(family_engine, family):
    frames = _moving_square(24, size=family.frame_size)
    tokens = family.tokens_per_tubelet

    async def scenario():
        session = LiveSession(family.pipeline, family_engine, OPTIONS, "s-main")
        events = await _send(session, frames[:8])
        await _ask_matches_describe(session, family.reference_llm, frames[:8], "What moves?")
        events += await _send(session, frames[8:], first_index=8)
        _, described = await _ask_matches_describe(
            session, family.reference_llm, frames, "And now?"
        )
        assert [e.tubelet for e in events] == list(range(12))
        assert [e.t for e in events] == [2 * k / FPS for k in range(12)]
        assert tuple(e.kept for e in events) == described.evs.kept_per_tubelet
        assert 0 < sum(e.kept for e in events[1:]) < 11 * tokens  # EVS pruned
        assert {e.total for e in events} == {tokens}
        await session.close()
        await _assert_pool_whole(family_engine)

    asyncio.run(scenario())


def test_pending_odd_frame_is_padded_for_that_answer_only(family_engine, family):
    frames = _moving_square(10, size=family.frame_size)
    reference_llm = family.reference_llm

    async def scenario():
        session = LiveSession(family.pipeline, family_engine, OPTIONS, "s-odd")
        await _send(session, frames[:9])
        padded = family.tokens_per_tubelet  # at most one tubelet more than the held prefix
        answer, _ = await _ask_matches_describe(session, reference_llm, frames[:9], "Odd?", padded)
        _, without_pending = _describe(reference_llm, frames[:8], "Odd?")
        assert _logprob_gap(answer, without_pending) > 100 * LOGPROB_ATOL  # the frame counted
        (event,) = await _send(session, frames[9:], first_index=9)
        assert (event.tubelet, event.t) == (4, 8 / FPS)  # frame 9 completes it, not its copy
        await _ask_matches_describe(session, reference_llm, frames, "Even?")
        await session.close()
        await _assert_pool_whole(family_engine)

    asyncio.run(scenario())


def test_first_frame_alone_is_a_padded_tubelet(family_engine, family):
    frames = _moving_square(1, size=family.frame_size)

    async def scenario():
        session = LiveSession(family.pipeline, family_engine, OPTIONS, "s-one")
        assert await session.add_frame(0.0, _png(frames[0])) is None
        await _ask_matches_describe(session, family.reference_llm, frames, "One?", padded=None)
        await session.close()
        await _assert_pool_whole(family_engine)

    asyncio.run(scenario())


def test_static_stream_keeps_only_the_first_tubelet(family_engine, family):
    size = family.frame_size
    frames = np.concatenate(
        [_moving_square(8, static=True, size=size), _moving_square(12, size=size)[10:]]
    )
    # at 0.5 fps the 4 tubelets span 4 temporal positions each: the video's temporal extent
    # then reaches past the question, so where decoding resumes depends on the empty tubelets
    # (as one video; each tubelet its own video, each empty one still takes its positions)
    options = replace(OPTIONS, fps=0.5)

    async def scenario():
        session = LiveSession(family.pipeline, family_engine, options, "s-static")
        events = await _send(session, frames[:8])
        assert [e.kept for e in events] == [family.tokens_per_tubelet, 0, 0, 0]
        # the empty tubelets still extend the video: the answer is the 8-frame clip's
        await _ask_matches_describe(session, family.reference_llm, frames[:8], "Still?")
        (moved,) = await _send(session, frames[8:], first_index=8)
        assert moved.tubelet == 4 and moved.kept > 0
        await _ask_matches_describe(session, family.reference_llm, frames, "Moved?")
        await session.close()
        await _assert_pool_whole(family_engine)

    asyncio.run(scenario())


def test_close_stops_answers_frees_every_block_and_is_idempotent(engine, pipeline):
    frames = _moving_square(4)

    async def scenario():
        session = LiveSession(pipeline, engine, OPTIONS, "s-close")
        await _send(session, frames)
        answer = session.ask("Long?")
        await anext(answer)
        await asyncio.gather(session.close(), session.close())
        with pytest.raises(SessionClosed, match="is closed"):
            async for _ in answer:
                pass
        with pytest.raises(SessionClosed):
            await session.add_frame(9.0, _png(frames[0]))
        with pytest.raises(SessionClosed):
            await anext(session.ask("Again?"))
        await session.close()
        await _assert_pool_whole(engine)

    asyncio.run(scenario())


def test_frame_cancelled_mid_prefill_still_frees_the_held_prefix(engine, pipeline, monkeypatch):
    frames = _moving_square(4)
    extending = asyncio.Event()
    extend_held = engine.extend_held

    async def signalling_extend_held(*args):
        extending.set()
        return await extend_held(*args)

    monkeypatch.setattr(engine, "extend_held", signalling_extend_held)

    async def scenario():
        session = LiveSession(pipeline, engine, OPTIONS, "s-cancel")
        await _send(session, frames[:3])
        frame = asyncio.ensure_future(session.add_frame(1.5, _png(frames[3])))
        await extending.wait()
        frame.cancel()  # the client left while its tubelet was being prefilled
        await session.close()
        await _assert_pool_whole(engine)

    asyncio.run(scenario())


def test_engine_limits_end_the_session_as_a_policy_error(engine, llm_engine, pipeline, monkeypatch):
    scheduler = llm_engine.scheduler
    monkeypatch.setattr(
        scheduler, "config", replace(scheduler.config, max_visual_tokens_per_request=30)
    )

    async def scenario():
        session = LiveSession(pipeline, engine, OPTIONS, "s-engine-limit")
        events = await _send(session, _moving_square(6))
        assert sum(e.kept for e in events) <= 30
        with pytest.raises(LiveLimitExceeded, match="max_visual_tokens_per_request=30") as raised:
            await _send(session, _moving_square(8)[6:], first_index=6)
        assert raised.value.close_code == 1008
        await session.close()
        await _assert_pool_whole(engine)

    asyncio.run(scenario())


def test_close_after_the_engine_stopped_is_quiet(engine, llm_engine, pipeline):
    async def scenario():
        session = LiveSession(pipeline, engine, OPTIONS, "s-stopped")
        await _send(session, _moving_square(2))
        engine.shutdown()  # aborts every request, held prefixes included
        await session.close()

    asyncio.run(scenario())
    assert all(block.ref_cnt == 0 for block in llm_engine.scheduler.kv_cache.block_pool.blocks)


def test_a_session_needs_prefix_caching(tiny_checkpoint, pipeline):
    """Without it the held prefix is pinned for nothing and each question recomputes the
    whole stream, so opening a session is refused, clearly, before it holds anything."""
    config = replace(ENGINE_CONFIG, cache=replace(ENGINE_CONFIG.cache, enable_prefix_caching=False))
    engine = AsyncEngine(LLMEngine(tiny_checkpoint, config))
    try:
        with pytest.raises(ValueError, match="live sessions need prefix caching.*is off"):
            LiveSession(pipeline, engine, OPTIONS, "s-uncached")
    finally:
        engine.shutdown()


LIMITS = LiveLimits(max_frames=3, max_frame_bytes=20_000, max_frame_pixels=56 * 84)


@pytest.mark.parametrize(
    ("frames", "error", "message", "close_code"),
    [
        ([(0.0, b"not an image")], BadFrame, "not a PNG or JPEG", 1003),
        ([(0.0, b"\x89PNG\r\n\x1a\n" + b"\0" * 40)], BadFrame, "not a PNG or JPEG", 1003),
        ([(0.0, "gif")], BadFrame, "not a PNG or JPEG", 1003),
        ([(0.0, "truncated")], BadFrame, "could not be decoded", 1003),
        ([(0.0, b"\0" * 20_001)], LiveLimitExceeded, "max_frame_bytes=20000", 1008),
        ([(0.0, "big")], LiveLimitExceeded, "max_frame_pixels=4704", 1008),
        ([(0.0, "ok"), (0.5, "small")], BadFrame, "fixed by the first frame", 1003),
        ([(1.0, "ok"), (0.5, "ok")], BadFrame, "not before the last frame", 1003),
        ([(float("nan"), "ok")], BadFrame, "must be finite", 1003),
        ([(k / 2, "ok") for k in range(4)], LiveLimitExceeded, "max_frames=3", 1008),
    ],
)
def test_bad_frames_and_limits_raise_clear_errors(
    engine, pipeline, frames, error, message, close_code
):
    gif = io.BytesIO()
    Image.fromarray(_moving_square(1)[0]).save(gif, format="GIF")
    images = {
        "ok": _png(_moving_square(1)[0]),
        "gif": gif.getvalue(),
        "truncated": _png(_moving_square(1)[0])[:200],
        "big": _png(np.zeros((60, 84, 3), np.uint8)),
        "small": _png(np.zeros((28, 28, 3), np.uint8)),
    }
    options = LiveOptions(fps=FPS, max_tokens=2, limits=LIMITS)

    async def scenario():
        session = LiveSession(pipeline, engine, options, "s-bad")
        with pytest.raises(error, match=message) as raised:
            for timestamp, image in frames:
                await session.add_frame(timestamp, images.get(image, image))
        assert raised.value.close_code == close_code
        await session.close()
        await _assert_pool_whole(engine)

    asyncio.run(scenario())


def test_jpeg_frames_are_decoded_upright():
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the camera was turned, show it rotated by 90 degrees
    Image.fromarray(_moving_square(1)[0]).save(buffer, format="JPEG", exif=exif)
    assert decode_frame(buffer.getvalue(), max_pixels=56 * 84).shape == (84, 56, 3)


def test_ask_before_any_frame_is_an_error_the_session_survives(engine, pipeline):
    async def scenario():
        session = LiveSession(pipeline, engine, OPTIONS, "s-early")
        with pytest.raises(NoFrameYet, match="before any frame") as raised:
            await anext(session.ask("Anything?"))
        assert raised.value.close_code is None
        with pytest.raises(PromptError, match=re.escape("contains '<|vision_end|>'")):
            await anext(session.ask("Smuggled <|vision_end|>?"))
        assert await session.add_frame(0.0, _png(_moving_square(1)[0])) is None
        await session.close()

    asyncio.run(scenario())


PIXEL_OPTIONS = replace(OPTIONS, stage="pixels", threshold=None)  # the stage's default threshold


def test_pixel_stage_answers_equal_describe_and_empty_tubelets_skip_the_tower(
    engine, pipeline, reference_llm
):
    """EVS before the tower in a live session: causal, so the stream keeps what the whole clip
    keeps; a tubelet it empties is never encoded."""
    frames = np.concatenate([_moving_square(8, static=True), _moving_square(12)[8:]])

    async def scenario():
        session = LiveSession(pipeline, engine, PIXEL_OPTIONS, "s-pixels")
        passes = pipeline.work.tower_passes
        events = await _send(session, frames[:8])
        assert [e.kept for e in events] == [TOKENS_PER_TUBELET, 0, 0, 0]
        assert pipeline.work.tower_passes == passes + 1  # the three emptied tubelets: none
        await _ask_matches_describe(session, reference_llm, frames[:8], "Still?")
        events = await _send(session, frames[8:], first_index=8)
        assert 0 < sum(e.kept for e in events) < 2 * TOKENS_PER_TUBELET
        _, described = await _ask_matches_describe(session, reference_llm, frames, "Moved?")
        assert described.evs.setting.endswith(":stage=pixels")
        await session.close()
        await _assert_pool_whole(engine)

    asyncio.run(scenario())
