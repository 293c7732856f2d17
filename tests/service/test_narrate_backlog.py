"""A narration under lag "queue" that falls behind holds at most `max_queued_tubelets`
tubelets: a frame past them is refused (`backlog_full`, the session goes on, the frame costs
no decode and no tower pass), every tubelet taken is still narrated in order, and the server
serves the next session. The Python API's feed waits instead of being refused.

The narrator is made slow deterministically: the language model's forward waits at a gate
the test opens, while frames keep being encoded on their own worker."""

import json
import threading

import httpx
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.service.config import ServerConfig
from stillcut.service.live_options import LiveLimits
from stillcut.service.narration import Narration

from .conftest import (
    NARRATE_START,
    make_llm,
    random_frame,
    running_server,
    settled_pool_state,
)

CAP = 2
START = {**NARRATE_START, "max_tokens_per_segment": 2}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with running_server(tiny_checkpoint, ServerConfig(max_queued_tubelets=CAP)) as server:
        yield server


@pytest.fixture
def gate():
    """What a held forward waits at; open at teardown, whatever happened, so that a failed
    test never leaves an engine thread waiting."""
    event = threading.Event()
    yield event
    event.set()


def _hold(model, gate: threading.Event, monkeypatch) -> None:
    """`model`'s forward waits at `gate` until it opens."""
    forward = model.forward

    def held(*args, **kwargs):
        gate.wait(timeout=120)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", held)


def _connect(server):
    return connect(server.url.replace("http://", "ws://") + "/v1/stream", proxy=None)


def _until(socket, kinds: dict[str, int]) -> list[dict]:
    """Messages until `kinds[type]` messages of each type have come."""
    messages, counts = [], dict.fromkeys(kinds, 0)
    while any(counts[kind] < n for kind, n in kinds.items()):
        message = json.loads(socket.recv(timeout=60))
        messages.append(message)
        counts[message["type"]] = counts.get(message["type"], 0) + 1
    return messages


def _narrate(server, frames: list[bytes]) -> list[dict]:
    """A narration of `frames` to its end: every message after the start, and the close code
    checked."""
    with _connect(server) as socket:
        socket.send(json.dumps(START))
        for frame in frames:
            socket.send(frame)
        socket.send(json.dumps({"type": "stop"}))
        return _to_the_close(socket)


def _to_the_close(socket) -> list[dict]:
    messages = []
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            messages.append(json.loads(socket.recv(timeout=60)))
    assert closed.value.rcvd.code == 1000, messages
    return messages


def test_frames_past_the_backlog_are_refused_and_the_server_goes_on(server, gate, monkeypatch):
    pipeline = server.app.state.service.llm.pipeline
    _hold(server.app.state.service.llm.engine.model, gate, monkeypatch)
    passes = pipeline.work.tower_passes
    num_frames = 40
    with _connect(server) as socket:
        socket.send(json.dumps(START))
        for k in range(num_frames):
            socket.send(random_frame(k / 2, seed=k))
        # one tubelet is being spoken about (held at the gate), CAP wait: the rest is refused
        taken = 2 * (CAP + 1)
        messages = _until(socket, {"frame": CAP + 1, "error": num_frames - taken})
        refused = [m for m in messages if m["type"] == "error"]
        assert {m["code"] for m in refused} == {"backlog_full"}
        assert f"max_queued_tubelets={CAP}" in refused[0]["message"]
        assert [m["message"].split(" s ")[0] for m in refused] == [
            f"the frame at {k / 2:g}" for k in range(taken, num_frames)
        ]
        assert pipeline.work.tower_passes - passes == CAP + 1  # refused frames: never encoded
        gate.set()
        segments = [m for m in _until(socket, {"segment": CAP + 1}) if m["type"] == "segment"]
        assert [s["t"] for s in segments] == [[k, k + 0.5] for k in range(CAP + 1)]
        # a refused frame was as if never sent: the client sends it again, and it is narrated
        for k in (taken, taken + 1):
            socket.send(random_frame(k / 2, seed=k))
        socket.send(json.dumps({"type": "stop"}))
        messages = _to_the_close(socket)
    assert [m["t"] for m in messages if m["type"] == "segment"] == [[CAP + 1, CAP + 1.5]]
    assert settled_pool_state(server) == (True, 0)
    assert httpx.get(f"{server.url}/health").json()["live_sessions"] == 0
    # the next session is served as any
    messages = _narrate(server, [random_frame(k / 2, seed=k) for k in range(4)])
    assert [m["type"] for m in messages].count("segment") == 2
    assert not [m for m in messages if m["type"] == "error"]
    assert settled_pool_state(server) == (True, 0)


def test_a_paced_python_feed_waits_for_room_instead_of_being_refused(
    tiny_checkpoint, gate, monkeypatch
):
    """`realtime` at 100 frames a second, one tubelet of room: the feed finds the backlog full
    while the narrator is held, waits for it to drain, and every tubelet is narrated."""
    llm = make_llm(tiny_checkpoint)
    _hold(llm.engine.model, gate, monkeypatch)
    full_when_waiting = []
    drain = Narration.drain

    async def opening_drain(self):
        full_when_waiting.append(self.backlog_full)
        gate.set()  # the feed waits now: let the narrator catch up
        await drain(self)

    monkeypatch.setattr(Narration, "drain", opening_drain)
    pixels = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    frames = [(k / 100, pixels + k) for k in range(12)]
    options = {"fps": 100.0, "lag": "queue", "threshold": None, "max_tokens_per_segment": 2}
    limits = LiveLimits(max_queued_tubelets=1)
    segments = list(llm.narrate(iter(frames), realtime=True, limits=limits, **options))
    assert full_when_waiting[0] is True
    assert [s.t for s in segments] == [(2 * k / 100, (2 * k + 1) / 100) for k in range(6)]
    assert all(s.skipped == 0 for s in segments)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_the_limit_is_checked_where_it_is_set(value):
    with pytest.raises(ValueError, match=f"max_queued_tubelets={value!r} must be an integer >= 1"):
        ServerConfig(max_queued_tubelets=value)
    with pytest.raises(ValueError, match=f"max_queued_tubelets={value!r} must be an integer >= 1"):
        LiveLimits(max_queued_tubelets=value)
