"""Narration over `WebSocket /v1/stream` (`"mode": "narrate"`), with the websockets client on
a real server: segments per tubelet under `queue`, the engine's own narration of the same
frames, bad start options, rollover at the context limit, a client that vanishes mid-segment.
Every block is back once a session ends or drops. Narrating in order, the engine's own
narration and what each append prefills are checked on Qwen3-VL too (its tubelets behind
`<t seconds>`, t their mean frame time), and on Qwen3.5 and Qwen3.5-MoE (Qwen3-VL's prompt over
a Gated DeltaNet hybrid, whose states carry a narration from one append to the next)."""

import asyncio
import contextlib
import json
import time
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.multimodal import MultiModalItem
from stillcut.service.config import ServerConfig
from stillcut.service.narrate_api import file_frames
from stillcut.service.narration import Narration

from .conftest import NARRATE_START, make_llm, png_frame, running_server, settled_pool_state

NUM_TUBELETS = 4
START = NARRATE_START


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with running_server(tiny_checkpoint, ServerConfig(max_sessions=2)) as server:
        yield server


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, tiny_checkpoint):
    return (
        tiny_checkpoint
        if family == "qwen2_5_vl"
        else cached_checkpoint("tiny", seed=1, family=family)
    )


@pytest.fixture(scope="module")
def family_server(request, checkpoint, tiny_checkpoint):
    """The shared server, or one of the other family's."""
    if checkpoint == tiny_checkpoint:
        yield request.getfixturevalue("server")
        return
    with running_server(checkpoint, ServerConfig(max_sessions=2)) as server:
        yield server


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)


def _frame(timestamp: float, seed: int) -> bytes:
    return png_frame(timestamp, _pixels(seed))


def _connect(server):
    return connect(server.url.replace("http://", "ws://") + "/v1/stream", proxy=None)


def _narrate(server, start: dict, num_frames: int, frames=None) -> tuple[list[dict], int]:
    """Send a start and the frames (random ones by default), then stop; every message until
    the close, and its code."""
    messages = []
    frames = frames or [_frame(k / 2, seed=k) for k in range(num_frames)]
    with _connect(server) as socket:
        socket.send(json.dumps(start))
        for frame in frames:
            socket.send(frame)
        socket.send(json.dumps({"type": "stop"}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(socket.recv(timeout=60)))
    return messages, closed.value.rcvd.code


def test_queue_narrates_every_tubelet_in_order_and_frees_everything(family_server):
    server = family_server
    messages, code = _narrate(server, START, 2 * NUM_TUBELETS)
    assert code == 1000 and messages[0]["type"] == "started"
    segments = [m for m in messages if m["type"] == "segment"]
    assert [s["t"] for s in segments] == [[k, k + 0.5] for k in range(NUM_TUBELETS)]
    assert all(s["skipped"] == 0 for s in segments)
    # the tokens streamed before each segment spell its text
    text, spelled = "", []
    for message in messages:
        if message["type"] == "token":
            text += message["text"]
        elif message["type"] == "segment":
            spelled.append(text)
            text = ""
    assert spelled == [s["text"] for s in segments]
    assert settled_pool_state(server) == (True, 0)


@pytest.mark.parametrize(
    ("option", "phrase"),
    [
        ({"max_tokens": 4}, "answer-only options"),
        ({"segment_end": ["x"] * 17}, "segment_end must hold 1 to 16"),
        ({"segment_end": ["x" * 257]}, "at most 256 characters"),
        ({"lag": "sometimes"}, "lag='sometimes' must be one of"),
        ({"prompt": " "}, "prompt must be a non-empty string"),
        ({"mode": "sing"}, "mode='sing': allowed 'narrate'"),
        ({"max_context_tokens": -5}, "max_context_tokens=-5 must be null or an integer in"),
        ({"max_context_tokens": 1}, "max_context_tokens=1 must be null or an integer in"),
        ({"keep_last_s": 1e9}, "keep_last_s=1000000000.0 must be a number in [0, 3600]"),
        ({"max_tokens_per_segment": 3000}, "max_tokens_per_segment=3000 leaves no room"),
        ({"stage": "pixels", "threshold": None}, "stage='pixels' needs a threshold (EVS is off)"),
        ({"stage": "sideways"}, "stage='sideways' is not one of ('embeddings', 'pixels')"),
    ],
)
def test_bad_narrate_options_end_the_socket_with_a_clear_error(server, option, phrase):
    with _connect(server) as socket:
        socket.send(json.dumps({**START, **option}))
        message = json.loads(socket.recv(timeout=30))
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=30)
    assert closed.value.rcvd.code == 1008
    assert message["code"] == "bad_start" and phrase in message["message"], message
    assert settled_pool_state(server) == (True, 0)


def test_rollover_at_the_context_limit_and_the_session_goes_on(server):
    start = {**START, "max_context_tokens": 120, "keep_last_s": 0.0}
    messages, code = _narrate(server, start, 2 * NUM_TUBELETS)
    kinds = [m["type"] for m in messages]
    assert code == 1000 and "rollover" in kinds
    assert kinds.count("segment") == NUM_TUBELETS  # every tubelet was still narrated
    assert settled_pool_state(server) == (True, 0)


def test_a_rollover_leaves_room_for_more_than_one_tubelet(server):
    """The fresh sequence holds at most half the context, so rollovers stay rare however long
    `keep_last_s` is (not one per tubelet, each re-prefilling nearly the whole context)."""
    start = {**START, "max_context_tokens": 200, "keep_last_s": 600.0}
    num_tubelets = 12
    messages, code = _narrate(server, start, 2 * num_tubelets)
    kinds = [m["type"] for m in messages]
    assert code == 1000 and kinds.count("segment") == num_tubelets
    assert 1 <= kinds.count("rollover") <= num_tubelets // 3, kinds
    assert settled_pool_state(server) == (True, 0)


def test_an_instruction_longer_than_the_context_ends_the_narration(server):
    """The error is reported, the session closes by itself, a later stop does not hang, and
    its slot and blocks are back."""
    start = {**START, "prompt": "Say what you see. " * 600}
    with _connect(server) as socket:
        socket.send(json.dumps(start))
        with contextlib.suppress(ConnectionClosed):  # it may close before every frame is sent
            for k in range(6):
                socket.send(_frame(k / 2, seed=k))
            socket.send(json.dumps({"type": "stop"}))
        messages = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(socket.recv(timeout=60)))
    errors = [m for m in messages if m["type"] == "error"]
    assert [e["code"] for e in errors] == ["context_too_small"], messages
    assert "max_context_tokens=2048" in errors[0]["message"]
    assert closed.value.rcvd.code == 1008
    assert settled_pool_state(server) == (True, 0)
    assert httpx.get(f"{server.url}/health").json()["live_sessions"] == 0


def test_a_client_that_vanishes_mid_segment_frees_its_request(server):
    with _connect(server) as socket:
        socket.send(json.dumps({**START, "max_tokens_per_segment": 24}))
        for k in range(2):
            socket.send(_frame(k / 2, seed=k))
        # the tubelet is committed and its segment under way when the client leaves
        while json.loads(socket.recv(timeout=60))["type"] != "frame":
            pass
    assert settled_pool_state(server) == (True, 0)


def test_video_llm_narrate_on_a_file_equals_the_websocket_narration(
    family_server, checkpoint, tiny_clip, tmp_path
):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    # sampled tokens (seeded) make the texts tell the two apart if anything differs
    options = {"max_tokens_per_segment": 4, "temperature": 1.0, "seed": 7, "threshold": 0.05}
    segments = list(make_llm(checkpoint).narrate(path, START["prompt"], **options))
    frames = [png_frame(t, pixels) for t, pixels in file_frames(path, 2.0)]
    messages, code = _narrate(family_server, {**START, **options}, len(frames), frames)
    sent = [m for m in messages if m["type"] == "segment"]
    assert code == 1000 and len(segments) == 3 and any(s.text for s in segments)
    assert [(list(s.t), s.text, s.skipped, s.kept_tokens, s.prefill_tokens) for s in segments] == [
        (m["t"], m["text"], m["skipped"], m["kept_tokens"], m["prefill_tokens"]) for m in sent
    ]
    assert settled_pool_state(family_server) == (True, 0)


def _wrapper_tokens(llm, segment) -> int:
    """The tokens a narration writes around a tubelet's kept ones: its time as the family
    writes it, and the vision start and end markers."""
    one = MultiModalItem("video", torch.zeros(1, 1), torch.zeros(1, 3, dtype=torch.long), (1, 2, 2))
    tubelet = replace(one, timestamps=tuple(segment.t))
    processor = llm.processor
    return len(processor.narration_input(tubelet, processor.tubelet_time(tubelet))) - 1


def test_a_static_stream_prefills_its_wrappers_and_the_kept_token_per_append(tiny_checkpoint):
    """Threshold EVS with floor 1: after the first tubelet a static scene keeps one token per
    tubelet, so each append prefills that token, its wrapper (timestamp text, vision start and
    end) and the last segment's final token, however long the stream."""
    llm = make_llm(tiny_checkpoint)
    pixels = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    frames = [(k / 2, pixels) for k in range(16)]
    options = {"threshold": 0.1, "floor": 1, "max_tokens_per_segment": 2}
    segments = list(llm.narrate(iter(frames), "Say what changes.", **options))
    assert len(segments) == 8
    for segment in segments[1:]:
        wrapper = len(llm.processor.encode(f"<{segment.t[0]:.1f}s>")) + 2
        assert segment.prefill_tokens == wrapper + 1 + 1


def test_a_moving_stream_prefills_each_appends_kept_tokens_and_its_wrapper(family, checkpoint):
    """Threshold EVS on a square crossing a still scene: each tubelet keeps the tokens the
    square touched (more or fewer as it goes), and each append prefills exactly those, its
    wrapper and the last segment's final token, the 12th as the 2nd (nothing grows with the
    stream)."""
    llm = make_llm(checkpoint)
    # a tubelet's tokens after the 2 x 2 merge (Qwen3-VL's tower resizes frames to 128 x 160)
    dense = 4 * 6 if family == "qwen2_5_vl" else 4 * 5
    ground = np.random.default_rng(0).integers(0, 256, (112, 168, 3), dtype=np.uint8)
    frames = []
    for k in range(24):
        pixels = ground.copy()
        x = 20 * k % 150
        pixels[30:58, x : x + 18] = 255  # an 18 x 28 square moving 20 px a frame
        frames.append((k / 2, pixels))
    options = {"threshold": 0.1, "floor": 1, "max_tokens_per_segment": 2}
    segments = list(llm.narrate(iter(frames), "Say what changes.", **options))
    assert len(segments) == 12
    assert segments[0].kept_tokens == dense  # the first tubelet has nothing to compare with
    kept = [segment.kept_tokens for segment in segments[1:]]
    assert all(0 < n < dense for n in kept) and len(set(kept)) > 1, kept
    for segment in segments[1:]:
        assert segment.prefill_tokens == segment.kept_tokens + _wrapper_tokens(llm, segment) + 1


def test_latest_skips_to_the_newest_tubelet_when_the_model_falls_behind(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint)
    forward = llm.engine.model.forward

    def slow_forward(*args, **kwargs):  # a segment now takes longer than a tubelet lasts
        time.sleep(0.25)
        return forward(*args, **kwargs)

    llm.engine.model.forward = slow_forward
    frames = [(k / 8, _pixels(k)) for k in range(16)]
    options = {"fps": 8.0, "lag": "latest", "threshold": None, "max_tokens_per_segment": 3}
    segments = list(llm.narrate(iter(frames), "Say what you see.", realtime=True, **options))
    assert any(s.skipped for s in segments)
    # every tubelet was either narrated or reported skipped, and time only moves forward
    assert len(segments) + sum(s.skipped for s in segments) == 8
    assert [s.t for s in segments] == sorted(s.t for s in segments)
    assert segments[-1].t == (14 / 8, 15 / 8)  # the newest is never skipped


@pytest.mark.parametrize(
    ("bad_frame", "code"),
    [
        (png_frame(1.0, np.zeros((84, 56, 3), np.uint8)), 1003),  # another size
        (_frame(0.2, seed=1), 1003),  # back in time
        (b"\0" * 4, 1003),  # no room for a timestamp
    ],
)
def test_bad_frames_end_a_narration_and_free_everything(server, bad_frame, code):
    with _connect(server) as socket:
        socket.send(json.dumps({**START, "max_tokens_per_segment": 24}))
        socket.send(_frame(0.0, seed=0))
        socket.send(_frame(0.5, seed=1))  # a tubelet: its segment may be under way
        socket.send(bad_frame)
        messages = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(socket.recv(timeout=30)))
    assert closed.value.rcvd.code == code and messages[-1]["type"] == "error"
    assert settled_pool_state(server) == (True, 0)


def test_a_client_that_leaves_after_stop_is_noticed_while_narration_drains(server, monkeypatch):
    """`stop` waits for what is queued to be narrated, but the socket is still read: a client
    that leaves meanwhile ends the session at once (here the narration would never finish)."""

    async def never_ends(self, arrived_at):
        await asyncio.Event().wait()

    monkeypatch.setattr(Narration, "_segment", never_ends)
    with _connect(server) as socket:
        socket.send(json.dumps(START))
        for k in range(2):
            socket.send(_frame(k / 2, seed=k))
        while json.loads(socket.recv(timeout=60))["type"] != "frame":
            pass
        socket.send(json.dumps({"type": "stop"}))
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/health").json()["live_sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/health").json()["live_sessions"] == 0
    assert settled_pool_state(server) == (True, 0)
