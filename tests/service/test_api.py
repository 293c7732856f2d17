"""The Python API: `describe_video` / `VideoLLM.describe` on every kind of video input, the
result's contents, the lazy `from stillcut import describe_video`, and an engine/kernels
import that never touches PyAV or FastAPI."""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

import stillcut
from stillcut.kernels.evs import EVSConfig
from stillcut.service.api import DEFAULT_EVS, VideoLLM

from .conftest import ENGINE_CONFIG

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return VideoLLM(tiny_checkpoint, engine_config=ENGINE_CONFIG)


def test_every_kind_of_video_input_gives_the_same_result(llm, tiny_clip, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    cache = llm.pipeline.cache
    hits, misses = cache.hits, cache.misses
    results = [
        llm.describe(source, "What moves?", max_tokens=MAX_TOKENS)
        for source in (tiny_clip, path, str(path), io.BytesIO(tiny_clip))
    ]
    first = results[0]
    for result in results[1:]:
        assert (result.text, result.token_ids, result.evs) == (
            first.text,
            first.token_ids,
            first.evs,
        )
        assert result.frame_timestamps == first.frame_timestamps
    assert first.finish_reason == "length" and len(first.token_ids) == MAX_TOKENS
    assert first.stop_reason is None and first.to_dict()["stop_reason"] is None
    assert first.evs.setting == DEFAULT_EVS.key()
    assert sum(first.evs.kept_per_tubelet) == first.evs.tokens_after < first.evs.tokens_before
    assert first.evs.frames == len(first.frame_timestamps) == 6
    assert first.usage.completion_tokens == MAX_TOKENS
    timings = first.timings
    assert 0 <= timings.queue_s <= timings.ttft_s <= timings.total_s
    assert timings.decode_s > 0 and timings.encode_s > 0
    assert (cache.misses - misses, cache.hits - hits) == (1, 3)  # the same media, encoded once
    data = json.loads(json.dumps(first.to_dict()))
    assert data["evs"]["kept_per_tubelet"] == list(first.evs.kept_per_tubelet)
    assert data["usage"]["total_tokens"] == first.usage.prompt_tokens + MAX_TOKENS


def test_frame_arrays_and_evs_settings(llm):
    frames = np.random.default_rng(0).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    off = llm.describe(frames, max_tokens=MAX_TOKENS, evs=None, frames_fps=4.0)
    assert off.evs.setting == "off" and off.evs.tokens_after == off.evs.tokens_before
    assert off.frame_timestamps == (0.0, 0.25, 0.5, 0.75)
    strict = llm.describe(frames, max_tokens=MAX_TOKENS, evs=EVSConfig("threshold", threshold=2.0))
    assert strict.evs.kept_per_tubelet[1:] == (0,)  # nothing differs by the maximum
    assert strict.usage.prompt_tokens < off.usage.prompt_tokens
    # other frames: the encoder cache keys a frame array by its pixels, not its timestamps
    stamped = llm.describe(
        frames[::-1].copy(), max_tokens=MAX_TOKENS, timestamps=[0, 1, 2, 3], progress=True
    )
    assert stamped.frame_timestamps == (0.0, 1.0, 2.0, 3.0)


def test_describe_many_equals_describe_one_by_one(llm, tiny_clip):
    frames = np.random.default_rng(1).integers(0, 256, (2, 56, 84, 3), dtype=np.uint8)
    together = llm.describe_many([tiny_clip, frames], "Same?", max_tokens=MAX_TOKENS)
    alone = [llm.describe(video, "Same?", max_tokens=MAX_TOKENS) for video in (tiny_clip, frames)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.evs for r in together] == [r.evs for r in alone]


def test_describe_video_is_lazy_and_caches_its_model(tiny_checkpoint, tiny_clip):
    from stillcut import describe_video

    assert describe_video is stillcut.describe_video
    first = describe_video(tiny_clip, model=tiny_checkpoint, max_tokens=2)
    again = describe_video(tiny_clip, model=str(tiny_checkpoint), max_tokens=2)
    assert first.token_ids == again.token_ids
    from stillcut.service.api import _cached_llm

    assert _cached_llm.cache_info().currsize == 1  # one model, loaded once
    with pytest.raises(AttributeError):
        stillcut.no_such_name  # noqa: B018


def test_a_served_model_refuses_direct_describe(tiny_checkpoint, tiny_clip):
    llm = VideoLLM(tiny_checkpoint, engine_config=ENGINE_CONFIG)
    engine = llm.start_async(max_queue=4)
    try:
        with pytest.raises(RuntimeError, match="AsyncEngine"):
            llm.describe(tiny_clip, max_tokens=2)
        with pytest.raises(RuntimeError, match="already"):
            llm.start_async()
    finally:
        engine.shutdown()


BLOCKER = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("av", "fastapi", "starlette", "uvicorn"):
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Blocker())
import stillcut.engine.llm_engine, stillcut.engine.factory, stillcut.kernels.evs
import stillcut, stillcut.engine, stillcut.kernels
assert not any(m.split(".")[0] in ("av", "fastapi") for m in sys.modules), sorted(sys.modules)
try:
    stillcut.describe_video
except ImportError as error:
    print("lazy:", error)
"""


def test_engine_and_kernels_import_without_pyav_or_fastapi():
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "lazy: av is blocked" in result.stdout  # only the service needs PyAV
