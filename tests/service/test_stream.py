"""A live session end to end over `WebSocket /v1/stream` with the `websockets` client: 24 PNG
frames, asks after 8 and after 24; each answer equals describing the same frames as one array
(same fps and EVS), and each ask prefills little more than its question."""

import io
import json
import struct

import numpy as np
from PIL import Image
from websockets.sync.client import connect

from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import VideoInput

from .conftest import settled_pool_state

FPS = 2.0
THRESHOLD = 0.1
MAX_TOKENS = 6
TOP_LOGPROBS = 5
BLOCK = 16  # the server's KV block size (conftest.ENGINE_CONFIG)
LOGPROB_ATOL = 1e-4


def _moving_square(num_frames: int) -> np.ndarray:
    """[T, 56, 84, 3] uint8: a fixed noisy background and a red square moving 3 px a frame."""
    background = np.random.default_rng(11).integers(40, 200, (56, 84, 3), dtype=np.uint8)
    frames = np.repeat(background[None], num_frames, axis=0)
    for k in range(num_frames):
        frames[k, 20:36, 3 * k % 68 : 3 * k % 68 + 16] = (250, 30, 30)
    return frames


def _frame_message(timestamp: float, frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return struct.pack("<d", timestamp) + buffer.getvalue()


def _receive_until(socket, kind: str) -> list[dict]:
    messages = []
    while not messages or messages[-1]["type"] != kind:
        messages.append(json.loads(socket.recv(timeout=60)))
        assert messages[-1]["type"] != "error", messages[-1]
    return messages


def _describe(llm, frames: np.ndarray, question: str):
    """describe_video's engine path on the frames as one array, with logprobs to compare."""
    evs = EVSConfig(mode="threshold", threshold=THRESHOLD)
    (item,) = llm.encode([VideoInput(frames, evs=evs, frames_fps=FPS)])
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)
    (output,) = llm.engine.generate([llm.processor.build_text(question, [item])], params)
    return output, item


def _assert_answer(answer: dict, tokens: list[dict], expected, question: str, processor):
    assert answer["text"] == expected.text == "".join(t["text"] for t in tokens)
    tops = [
        [top["logprob"] for top in entry["top_logprobs"]] for entry in answer["logprobs"]["content"]
    ]
    expected_tops = [top for _, top, _ in expected.logprobs]
    assert np.abs(np.array(tops) - np.array(expected_tops)).max() <= LOGPROB_ATOL
    usage = answer["usage"]
    prefilled = usage["prompt_tokens"] - usage["cached_tokens"]
    assert prefilled <= len(processor.ask_suffix(question)) + BLOCK  # the video was held


def test_live_session_answers_equal_describe_on_the_same_frames(main_server, reference_llm):
    frames = _moving_square(24)
    url = main_server.url.replace("http://", "ws://") + "/v1/stream"
    start = {"type": "start", "threshold": THRESHOLD, "fps": FPS, "max_tokens": MAX_TOKENS}
    events, answers = [], []
    with connect(url, proxy=None) as socket:
        socket.send(json.dumps({**start, "logprobs": TOP_LOGPROBS}))
        assert json.loads(socket.recv(timeout=30))["type"] == "started"
        for first, last, question in ((0, 8, "What moves?"), (8, 24, "And now?")):
            for k in range(first, last):
                socket.send(_frame_message(k / FPS, frames[k]))
            for _ in range((last - first) // 2):
                events.append(json.loads(socket.recv(timeout=60)))
            socket.send(json.dumps({"type": "ask", "prompt": question}))
            answers.append((_receive_until(socket, "answer"), last, question))
        socket.send(json.dumps({"type": "stop"}))
    assert [e["type"] for e in events] == ["frame"] * 12
    assert [e["tubelet"] for e in events] == list(range(12))
    assert [e["t"] for e in events] == [2 * k / FPS for k in range(12)]
    processor = reference_llm.processor
    for messages, num_frames, question in answers:
        expected, item = _describe(reference_llm, frames[:num_frames], question)
        _assert_answer(messages[-1], messages[:-1], expected, question, processor)
    assert tuple(e["kept"] for e in events) == item.kept_per_tubelet
    assert 0 < sum(item.kept_per_tubelet[1:]) < 11 * events[0]["total"]  # EVS pruned
    assert settled_pool_state(main_server.server) == (True, 0)  # the held prefix was released
