"""Load and departures: 32 requests at once against an admission queue of 8 each get a correct
answer or a 503 with Retry-After, none hangs, and no block stays in use; a question about a
video already encoded does not wait behind another encode; a client that leaves mid-stream has
its request aborted."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from stillcut.service.config import ServerConfig
from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import data_url, pool_state, running_server

NUM_REQUESTS = 32
MAX_QUEUE = 8
MAX_TOKENS = 4
PROMPT = "What moves?"


@pytest.fixture(scope="module")
def busy_server(tiny_checkpoint):
    with running_server(tiny_checkpoint, ServerConfig(max_queue=MAX_QUEUE)) as server:
        yield server


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[bytes]:
    """Distinct clips, so every request pays for its own encode."""
    folder = tmp_path_factory.mktemp("clips")
    clips = []
    for seed in range(NUM_REQUESTS):
        write_video(folder / f"{seed}.mp4", moving_texture(4, 112, 84, seed=seed))
        clips.append((folder / f"{seed}.mp4").read_bytes())
    return clips


def _chat(clip: bytes, **extra) -> dict:
    parts = [
        {"type": "video_url", "video_url": {"url": data_url(clip)}},
        {"type": "text", "text": PROMPT},
    ]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS, **extra}


def test_32_requests_against_a_queue_of_8(busy_server, clips, reference_llm):
    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=120) as client:
            sends = [client.post("/v1/chat/completions", json=_chat(clip)) for clip in clips]
            return await asyncio.wait_for(asyncio.gather(*sends), timeout=180)

    responses = asyncio.run(send_all())
    expected = reference_llm.describe_many(clips, PROMPT, max_tokens=MAX_TOKENS)
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= MAX_QUEUE  # the queue's worth is always served
    for response, reference in zip(responses, expected, strict=True):
        if response.status_code == 503:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["code"] == "queue_full"
            continue
        body = response.json()
        assert body["choices"][0]["message"]["content"] == reference.text
        assert body["usage"]["prompt_tokens"] == reference.usage.prompt_tokens
        assert body["evs"]["kept_per_tubelet"] == list(reference.evs.kept_per_tubelet)
    assert pool_state(busy_server) == (True, 0)
    assert httpx.get(f"{busy_server.url}/health").json()["requests_waiting"] == 0


def test_a_question_about_a_cached_video_does_not_wait_for_the_encode_worker(busy_server, clips):
    """With the encode worker held by another job, a second question about a clip already
    encoded is answered from the encoder cache, as the first was."""
    url, encoder = f"{busy_server.url}/v1/chat/completions", busy_server.app.state.service.encoder
    first = httpx.post(url, json=_chat(clips[0], temperature=0), timeout=120)
    assert first.status_code == 200
    release = threading.Event()
    busy = threading.Thread(target=lambda: asyncio.run(encoder.run(lambda: release.wait(60))))
    busy.start()
    try:
        while encoder.num_pending == 0:
            time.sleep(0.01)
        second = httpx.post(url, json=_chat(clips[0], temperature=0), timeout=30)
        assert encoder.num_pending == 1  # the worker was still held
    finally:
        release.set()
        busy.join()
    assert second.status_code == 200, second.text
    answers = [response.json() for response in (first, second)]
    assert answers[1]["choices"][0]["message"] == answers[0]["choices"][0]["message"]
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_client_that_leaves_mid_stream_has_its_request_aborted(busy_server, caplog):
    body = {
        "messages": [{"role": "user", "content": "Talk for a long time."}],
        "max_tokens": 1800,
        "stream": True,
    }
    headers = {"X-Request-Id": "leaves-early"}
    with caplog.at_level("INFO", logger="stillcut.access"):
        with httpx.stream(
            "POST", f"{busy_server.url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: {") or not line for line in received)
        for _ in range(200):
            if pool_state(busy_server) == (True, 0):
                break
            asyncio.run(asyncio.sleep(0.05))
        assert pool_state(busy_server) == (True, 0)
        for _ in range(100):  # the log line is written once the handler has unwound
            if any("leaves-early" in r.message for r in caplog.records):
                break
            asyncio.run(asyncio.sleep(0.05))
    (line,) = [json.loads(r.message) for r in caplog.records if "leaves-early" in r.message]
    assert "finish_reason" not in line and line["completion_tokens"] == 0  # never finished
