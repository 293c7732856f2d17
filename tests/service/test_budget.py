"""What a request may cost is known before any frame is decoded: requests over the engine's
budget or the server's ceilings are refused at once, naming the limit, and do no work (the
server's own counters of decoded frames and tower passes stay put); a clip attached several
times is decoded and encoded once."""

import json
import logging
import time
from fractions import Fraction

import httpx
import pytest

from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.synthetic import gray_frames, moving_texture, write_video
from stillcut.vision.work import VisionWork

from .conftest import (
    MAX_DURATION_S,
    MAX_VISUAL_TOKENS,
    assert_error,
    assert_healthy,
    data_url,
    work_done,
)

DESCRIBE = "/v1/videos/describe"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("budget")
    sparse = folder / "sparse.mp4"  # 2 frames, the second near the end of the duration limit
    frames = gray_frames([40, 200], 320, 240)
    write_video(sparse, frames, pts=[0, MAX_DURATION_S - 2], time_base=Fraction(1))
    raw = folder / "raw.h264"  # 10 s without a container: no declared duration
    write_video(raw, gray_frames([90] * 300, 320, 240), container_format="h264")
    fresh = folder / "fresh.mp4"  # encoded by one test only
    write_video(fresh, moving_texture(8, 112, 84, seed=21), time_base=Fraction(1, 4))
    for seed in range(3):  # three more, encoded together in one tower pass
        write_video(folder / f"batch{seed}.mp4", moving_texture(8, 320, 240, seed=30 + seed))
    return {path.stem: path.read_bytes() for path in folder.iterdir()}


def _describe(url: str, clip: bytes, **fields) -> httpx.Response:
    files = {"file": ("v.mp4", clip, "video/mp4")}
    return httpx.post(f"{url}{DESCRIBE}", files=files, data={"max_tokens": 2, **fields}, timeout=60)


def _chat(url: str, parts: list[dict], **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, **fields}
    return httpx.post(f"{url}{CHAT}", json=body, timeout=60)


def _video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def _refused_without_work(main_server, send, status: int, code: str, phrase: str) -> dict:
    before = work_done(main_server.url)
    error = assert_error(send(), status, code, phrase)
    assert work_done(main_server.url) == before  # no frame decoded, no tower pass
    assert_healthy(main_server.server)
    return error


@pytest.mark.parametrize("include_frames", ["false", "true"])
def test_a_sparse_clip_sampled_densely_is_refused_before_decoding(
    main_server, clips, include_frames
):
    """1 KB, 2 frames 28 s apart, asked at 8 fps: 224 frames would be decoded and encoded."""
    fields = {"fps": "8", "max_frames": "256", "include_frames": include_frames}
    _refused_without_work(
        main_server,
        lambda: _describe(main_server.url, clips["sparse"], **fields),
        400,
        "too_many_visual_tokens",
        f"max_visual_tokens_per_request={MAX_VISUAL_TOKENS} (known before decoding)",
    )


def test_the_sparse_clip_asked_past_the_ceilings_is_refused_at_once(main_server, clips):
    """The same clip with the fields that used to decode 2,000 frames."""
    fields = {"fps": "10", "max_frames": "2000", "include_frames": "true"}
    _refused_without_work(
        main_server,
        lambda: _describe(main_server.url, clips["sparse"], **fields),
        400,
        "over_limit",
        "fps=10 exceeds the server's limit_fps=8",
    )


def test_a_stream_without_duration_is_refused_before_decoding(main_server, clips):
    _refused_without_work(
        main_server,
        lambda: _describe(main_server.url, clips["raw"], fps="8", max_frames="256"),
        400,
        "too_many_visual_tokens",
        "known before decoding",
    )


def test_media_and_max_tokens_over_the_context_are_refused_before_decoding(main_server):
    parts = [_video_part(data_url(main_server.clip)), {"type": "text", "text": "?"}]
    _refused_without_work(
        main_server,
        lambda: _chat(main_server.url, parts, evs="off", max_tokens=2000),
        400,
        "context_length_exceeded",
        "max_model_len=2048 (known before decoding)",
    )


@pytest.mark.parametrize(
    ("fields", "phrase"),
    [({"max_frames": "5000"}, "limit_frames=4096"), ({"fps": "10"}, "limit_fps=8")],
)
def test_asking_past_a_ceiling_is_refused(main_server, fields, phrase):
    _refused_without_work(
        main_server,
        lambda: _describe(main_server.url, main_server.clip, **fields),
        400,
        "over_limit",
        phrase,
    )
    typed = {name: float(value) if name == "fps" else int(value) for name, value in fields.items()}
    parts = [_video_part(data_url(main_server.clip))]
    _refused_without_work(
        main_server, lambda: _chat(main_server.url, parts, **typed), 400, "over_limit", phrase
    )


def test_more_media_parts_than_the_ceiling_are_refused(main_server):
    parts = [_video_part(data_url(main_server.clip))] * 40
    _refused_without_work(
        main_server,
        lambda: _chat(main_server.url, parts),
        400,
        "too_many_media",
        "40 media parts; the server's limit_mm_per_prompt=8",
    )


def test_a_clip_attached_three_times_is_decoded_and_encoded_once(main_server, clips):
    once = VisionWork()
    video = decode_video(clips["fresh"], DecodeConfig(max_duration_s=MAX_DURATION_S), work=once)
    frames_before, passes_before = work_done(main_server.url)
    response = _chat(main_server.url, [_video_part(data_url(clips["fresh"]))] * 3)
    assert response.status_code == 200, response.text
    frames, passes = work_done(main_server.url)
    assert (frames - frames_before, passes - passes_before) == (once.frames_decoded, 1)
    assert response.json()["evs"]["frames"] == 3 * len(video.timestamps)  # all three are asked
    assert_healthy(main_server.server)


def test_encode_seconds_are_the_requests_own_wall_time(main_server, clips, caplog):
    """Three clips share one tower pass; counting it once per item made encode_s exceed the
    request's whole time."""
    parts = [_video_part(data_url(clips[f"batch{k}"])) for k in range(3)]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    with caplog.at_level(logging.INFO, logger="stillcut.access"):
        response = httpx.post(
            f"{main_server.url}{CHAT}",
            json=body,
            headers={"X-Request-Id": "three-clips"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        for _ in range(100):  # the log line is written once the handler has unwound
            if any("three-clips" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.02)
    (line,) = [
        json.loads(r.getMessage()) for r in caplog.records if "three-clips" in r.getMessage()
    ]
    assert 0 < line["decode_s"] and 0 < line["encode_s"]
    assert line["decode_s"] + line["encode_s"] <= line["total_s"]
