"""One request never stops the service. A step that raises (planted here, as a request the
sampler could not take would) fails the requests it ran with a retryable 500 `step_failed` (a
WebSocket error of that code) that names nothing internal; their blocks are freed and the next
request is answered. Options that could make a step raise are refused where they are parsed,
naming the option, at every entry point."""

import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .conftest import (
    assert_error,
    assert_healthy,
    engine_call,
    plant_step_failure,
    random_frame,
    settled_pool_state,
)

CHAT = "/v1/chat/completions"
DESCRIBE = "/v1/videos/describe"
HUGE = 2**63  # past int64: the sampler could not build its tensor
INTERNALS = ("planted", "Overflow", "Traceback", "object at 0x")


def _chat(main_server, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 2, **extra}
    return httpx.post(f"{main_server.url}{CHAT}", json=body, timeout=60)


def _describe(main_server, **fields) -> httpx.Response:
    files = {"file": ("clip.mp4", main_server.clip, "video/mp4")}
    data = {"max_tokens": "2", **fields}
    return httpx.post(f"{main_server.url}{DESCRIBE}", files=files, data=data, timeout=60)


def _socket(main_server):
    return connect(main_server.url.replace("http://", "ws://") + "/v1/stream", proxy=None)


def _until(socket, kind: str) -> dict:
    while (message := json.loads(socket.recv(timeout=60)))["type"] != kind:
        pass
    return message


def _closed(socket) -> tuple[int, str]:
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            socket.recv(timeout=60)
    return closed.value.rcvd.code, closed.value.rcvd.reason


def _assert_step_failed(response: httpx.Response) -> None:
    error = assert_error(response, 500, "step_failed", "may be retried")
    assert response.headers["retry-after"] == "1"
    assert not any(word in error["message"] for word in INTERNALS), error


@pytest.mark.parametrize("ask", [_chat, _describe], ids=["chat", "describe"])
def test_a_failed_step_fails_its_http_request_and_the_next_one_is_answered(main_server, ask):
    server = main_server.server
    engine_call(server, plant_step_failure)
    _assert_step_failed(ask(main_server))
    assert_healthy(server)
    assert ask(main_server).status_code == 200


def test_a_failed_step_fails_a_streamed_chat_in_its_stream(main_server):
    engine_call(main_server.server, plant_step_failure)
    response = _chat(main_server, stream=True)
    assert response.status_code == 500  # the first output never came: no stream was opened
    _assert_step_failed(response)
    assert_healthy(main_server.server)


def test_a_failed_step_ends_a_live_session_and_the_next_one_runs(main_server):
    server = main_server.server
    engine_call(server, plant_step_failure)
    with _socket(main_server) as socket:  # the held prefix's first prefill fails
        socket.send(json.dumps({"type": "start", "max_tokens": 2}))
        _until(socket, "started")
        socket.send(random_frame(0.0, 1))
        socket.send(random_frame(0.5, 2))
        error = _until(socket, "error")
        code, reason = _closed(socket)
    assert error["code"] == "step_failed" and code == 1011
    assert not any(word in error["message"] + reason for word in INTERNALS), (error, reason)
    assert_healthy(server)
    with _socket(main_server) as socket:  # an answer fails: reported, and the session goes on
        socket.send(json.dumps({"type": "start", "max_tokens": 2}))
        socket.send(random_frame(0.0, 1))
        socket.send(random_frame(0.5, 2))
        _until(socket, "frame")
        engine_call(server, plant_step_failure)
        socket.send(json.dumps({"type": "ask", "prompt": "What?"}))
        assert _until(socket, "error")["code"] == "step_failed"
        socket.send(json.dumps({"type": "ask", "prompt": "What?"}))
        assert _until(socket, "answer")["usage"]["completion_tokens"] == 2
        socket.send(json.dumps({"type": "stop"}))
        assert _closed(socket)[0] == 1000
    assert_healthy(server)


NARRATE = {
    "type": "start",
    "mode": "narrate",
    "prompt": "Say what you see.",
    "lag": "queue",
    "max_tokens_per_segment": 2,
}


def test_a_failed_step_ends_a_narration_and_the_next_one_runs(main_server):
    server = main_server.server
    engine_call(server, plant_step_failure)
    with _socket(main_server) as socket:
        socket.send(json.dumps(NARRATE))
        socket.send(random_frame(0.0, 1))
        socket.send(random_frame(0.5, 2))
        error = _until(socket, "error")
        code, reason = _closed(socket)  # without a stop: the session ends by itself
    assert error["code"] == "step_failed" and code == 1011
    assert not any(word in error["message"] + reason for word in INTERNALS), (error, reason)
    assert_healthy(server)
    with _socket(main_server) as socket:
        socket.send(json.dumps(NARRATE))
        socket.send(random_frame(0.0, 1))
        socket.send(random_frame(0.5, 2))
        socket.send(json.dumps({"type": "stop"}))
        assert _until(socket, "segment")["t"] == [0.0, 0.5]
        assert _closed(socket)[0] == 1000
    assert_healthy(server)


def _ws_start_error(main_server, start: dict) -> tuple[dict, int]:
    with _socket(main_server) as socket:
        socket.send(json.dumps(start))
        message = json.loads(socket.recv(timeout=30))
        return message, _closed(socket)[0]


@pytest.mark.parametrize(
    ("option", "value"),
    [("top_k", HUGE), ("max_tokens", HUGE), ("seed", 2**64), ("temperature", 1e308)],
)
def test_sampling_options_past_their_range_are_refused_at_every_entry_point(
    main_server, option, value
):
    sampling = {"temperature": 1.0, option: value}
    assert_error(_chat(main_server, **sampling), 400, "invalid_parameter", f"{option}=")
    form = {name: str(v) for name, v in sampling.items()}
    assert_error(_describe(main_server, **form), 400, "invalid_parameter", f"{option}=")
    for start in ({"type": "start"}, NARRATE):
        if option == "max_tokens" and start is NARRATE:
            sampling = {"temperature": 1.0, "max_tokens_per_segment": value}
        message, code = _ws_start_error(main_server, {**start, **sampling})
        assert code == 1008 and message["code"] == "bad_start", message
        assert f"{option}=" in message["message"], message
    assert _chat(main_server, temperature=1.0, top_k=5, seed=7).status_code == 200
    assert settled_pool_state(main_server.server) == (True, 0)
