"""`POST /v1/videos/describe` with httpx: a multipart upload answered as JSON or as server-sent
events, equal to `VideoLLM.describe` on the same bytes; request ids, deadlines, metrics."""

import json
import time

import httpx
import pytest

from stillcut.kernels.evs import EVSConfig

from .conftest import pool_state

MAX_TOKENS = 5


def _upload(main_server, **fields):
    return {"file": ("clip.mp4", main_server.clip, "video/mp4")}, {
        "max_tokens": MAX_TOKENS,
        **fields,
    }


def _events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_upload_answers_as_describe_does(main_server, reference_llm):
    files, data = _upload(main_server, prompt="What moves?")
    response = httpx.post(f"{main_server.url}/v1/videos/describe", files=files, data=data)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = reference_llm.describe(main_server.clip, "What moves?", max_tokens=MAX_TOKENS)
    assert body["text"] == expected.text and body["token_ids"] == list(expected.token_ids)
    assert body["evs"] == expected.to_dict()["evs"]
    assert body["frame_timestamps"] == list(expected.frame_timestamps)
    assert body["id"] == response.headers["x-request-id"]
    assert set(body["timings"]) == {"decode_s", "encode_s", "queue_s", "ttft_s", "total_s"}
    assert body["usage"]["prompt_tokens"] == expected.usage.prompt_tokens
    assert (body["finish_reason"], body["stop_reason"]) == ("length", None)
    stop = expected.text[:1]
    files, data = _upload(main_server, prompt="What moves?", stop=stop)
    stopped = httpx.post(f"{main_server.url}/v1/videos/describe", files=files, data=data).json()
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)


def test_streamed_upload_sends_tokens_then_the_result(main_server, reference_llm):
    evs = {"mode": "threshold", "threshold": 0.05}
    files, data = _upload(main_server, stream="true", evs=json.dumps(evs))
    url = f"{main_server.url}/v1/videos/describe"
    with httpx.stream("POST", url, files=files, data=data) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    expected = reference_llm.describe(main_server.clip, evs=EVSConfig(**evs), max_tokens=MAX_TOKENS)
    assert events[-1] == "[DONE]"
    result = events[-2]
    assert result["type"] == "result" and result["text"] == expected.text
    assert "".join(e["text"] for e in events[:-2] if e["type"] == "token") == expected.text
    assert result["evs"]["setting"] == EVSConfig(**evs).key()
    assert result["evs"]["kept_per_tubelet"] == list(expected.evs.kept_per_tubelet)


def test_client_request_id_is_echoed_and_logged(main_server, caplog):
    files, data = _upload(main_server)
    with caplog.at_level("INFO", logger="stillcut.access"):
        response = httpx.post(
            f"{main_server.url}/v1/videos/describe",
            files=files,
            data=data,
            headers={"X-Request-Id": "client-id-42"},
        )
        deadline = time.monotonic() + 10  # the line is written once the last byte is out
        while not (lines := _access_lines(caplog, "client-id-42")):
            assert time.monotonic() < deadline, "no access line"
            time.sleep(0.02)
    assert response.headers["x-request-id"] == "client-id-42" == response.json()["id"]
    (line,) = lines
    assert line["endpoint"] == "/v1/videos/describe" and line["status"] == 200
    assert line["completion_tokens"] == MAX_TOKENS and 0 < line["evs_kept"] < line["evs_total"]
    assert {"decode_s", "encode_s", "queue_s", "ttft_s", "total_s"} <= set(line)


def _access_lines(caplog, request_id: str) -> list[dict]:
    lines = [json.loads(r.message) for r in caplog.records if r.name == "stillcut.access"]
    return [line for line in lines if line["request_id"] == request_id]


def test_a_missed_deadline_is_a_504_and_frees_the_request(main_server):
    files, data = _upload(main_server, max_tokens=1500)
    response = httpx.post(
        f"{main_server.url}/v1/videos/describe",
        files=files,
        data=data,
        headers={"X-Request-Timeout": "0.3"},
        timeout=30,
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert pool_state(main_server.server) == (True, 0)


def test_health_and_metrics(main_server):
    health = httpx.get(f"{main_server.url}/health").json()
    assert health["status"] == "ok" and health["kv_blocks_used"] == 0
    text = httpx.get(f"{main_server.url}/metrics").text
    for name in (
        'stillcut_requests_total{endpoint="/v1/videos/describe",status="200"}',
        "stillcut_time_to_first_token_seconds_bucket",
        "stillcut_request_duration_seconds_bucket",
        "stillcut_evs_tokens_kept_total",
        "stillcut_evs_tokens_pruned_total",
        "stillcut_kv_blocks_used",
        "stillcut_prefix_cache_hit_rate",
        "stillcut_queue_depth",
    ):
        assert name in text, name


@pytest.mark.parametrize("header", ["abc", "-1", "inf"])
def test_a_bad_deadline_header_is_a_400(main_server, header):
    files, data = _upload(main_server)
    response = httpx.post(
        f"{main_server.url}/v1/videos/describe",
        files=files,
        data=data,
        headers={"X-Request-Timeout": header},
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_header"
