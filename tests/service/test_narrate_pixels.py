"""Narration with EVS before the tower (`"stage": "pixels"`, `stage=`, `--evs-stage`): each
tubelet keeps the merge groups the pixel metric keeps over the whole clip, the tower encodes
those only and a tubelet it empties costs no tower pass; the WebSocket narrates as the Python
API does; a narrating family whose tower cannot encode a subset refuses the stage, clearly,
and the server goes on serving."""

import contextlib
import dataclasses
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.models.families import FAMILIES
from stillcut.engine.models.qwen2_vl.entry import QWEN2_5_VL
from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.pixels import PIXEL_THRESHOLD
from stillcut.service.api import VideoLLM
from stillcut.service.config import ServerConfig
from stillcut.vision.pixel_stage import merged_grid

from .conftest import ENGINE_CONFIG, make_llm, png_frame, running_server, settled_pool_state

PROMPT = "Say what changes."
NUM_STATIC = 8  # frames: the first tubelet is kept whole, the next three are emptied
SAMPLING = {"max_tokens_per_segment": 3, "temperature": 1.0, "seed": 5}


def _frames() -> np.ndarray:
    """[16, 84, 112, 3] uint8: a still textured scene, then a bright square crossing it."""
    ground = np.random.default_rng(3).integers(40, 200, (84, 112, 3), dtype=np.uint8)
    frames = np.repeat(ground[None], 16, axis=0)
    for k in range(NUM_STATIC, 16):
        x = 12 * (k - NUM_STATIC)
        frames[k, 28:56, x : x + 28] = 255
    return frames


def _timed(frames: np.ndarray) -> list[tuple[float, np.ndarray]]:
    return [(k / 2, frame) for k, frame in enumerate(frames)]


def _pixel_masks(llm: VideoLLM, frames: np.ndarray) -> torch.Tensor:
    """[tubelets, tokens] bool: what threshold EVS at the pixel stage's default keeps of the
    whole clip, measured on its pixels."""
    media = llm.pipeline.media
    prepared = media.prepare_video(frames, 2.0)
    grid = merged_grid(prepared.grid_thw, media.merge_size)
    evs = EVSConfig(mode="threshold", threshold=PIXEL_THRESHOLD, stage="pixels")
    return prune(media.pixel_features(prepared), grid, evs).mask.reshape(grid[0], -1)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return make_llm(tiny_checkpoint)


def test_the_tower_encodes_only_the_groups_the_pixel_metric_keeps(llm, monkeypatch):
    frames = _frames()
    expected = _pixel_masks(llm, frames)
    num_kept = expected.sum(1).tolist()
    num_tokens = expected.shape[1]
    assert num_kept[0] == num_tokens and num_kept[1:4] == [0, 0, 0]
    assert all(0 < n < num_tokens for n in num_kept[4:]), num_kept
    kept_inputs = []  # what the tower was asked to encode, per tubelet it ran on
    encode = llm.pipeline.tower.encode

    def recorded(patches_list, grids, kept=None):
        kept_inputs.extend(kept if kept is not None else [None] * len(grids))
        return encode(patches_list, grids, kept)

    monkeypatch.setattr(llm.pipeline.tower, "encode", recorded)
    passes = llm.pipeline.work.tower_passes
    segments = list(llm.narrate(_timed(frames), PROMPT, stage="pixels", **SAMPLING))
    spoken = [k for k, n in enumerate(num_kept) if n]  # an emptied tubelet gets no segment
    assert [s.t for s in segments] == [(float(k), k + 0.5) for k in spoken]
    assert [s.kept_tokens for s in segments] == [num_kept[k] for k in spoken]
    assert llm.pipeline.work.tower_passes - passes == len(spoken)  # none for emptied tubelets
    assert len(kept_inputs) == len(spoken)
    for kept, k in zip(kept_inputs, spoken, strict=True):
        assert torch.equal(kept.flatten(), expected[k])


def _socket(server):
    return connect(server.url.replace("http://", "ws://") + "/v1/stream", proxy=None)


def _narrate(server, start: dict, frames: np.ndarray) -> tuple[list[dict], int]:
    """Every message of a narration of `frames` until the close, and its code."""
    messages = []
    with _socket(server) as socket:
        socket.send(json.dumps({"type": "start", "mode": "narrate", **start}))
        with contextlib.suppress(ConnectionClosed):  # a refused start closes before the frames
            for timestamp, pixels in _timed(frames):
                socket.send(png_frame(timestamp, pixels))
            socket.send(json.dumps({"type": "stop"}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                messages.append(json.loads(socket.recv(timeout=60)))
    return messages, closed.value.rcvd.code


def test_the_websocket_narrates_at_the_pixel_stage_as_the_python_api(llm, tiny_checkpoint):
    frames = _frames()
    ours = list(llm.narrate(_timed(frames), PROMPT, stage="pixels", **SAMPLING))
    start = {"prompt": PROMPT, "lag": "queue", "stage": "pixels", **SAMPLING}
    with running_server(tiny_checkpoint, ServerConfig(max_sessions=2)) as server:
        messages, code = _narrate(server, start, frames)
        assert settled_pool_state(server) == (True, 0)
    assert code == 1000
    events = [m for m in messages if m["type"] == "frame"]
    assert [e["kept"] for e in events] == _pixel_masks(llm, frames).sum(1).tolist()
    sent = [m for m in messages if m["type"] == "segment"]
    assert any(s.text for s in ours)
    assert [(list(s.t), s.text, s.kept_tokens, s.prefill_tokens) for s in ours] == [
        (m["t"], m["text"], m["kept_tokens"], m["prefill_tokens"]) for m in sent
    ]


REFUSAL = "its tower encodes each frame whole"
TOY = dataclasses.replace(QWEN2_5_VL, model_type="toy_whole_frames", pixel_stage_refusal=REFUSAL)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint relabelled as a family that narrates but refuses the pixel stage,
    registered for this module's tests only."""
    folder = tmp_path_factory.mktemp("toy") / "checkpoint"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": TOY.model_type}))
    with FAMILIES.registered(TOY):
        yield folder


def test_a_family_refusing_the_stage_ends_the_start_and_the_server_goes_on(toy_checkpoint):
    frames = _frames()[:4]
    start = {"prompt": PROMPT, "lag": "queue", "threshold": None, "max_tokens_per_segment": 2}
    with running_server(toy_checkpoint, ServerConfig(max_sessions=1)) as server:
        passes = server.app.state.service.llm.pipeline.work.tower_passes
        messages, code = _narrate(server, {**start, "threshold": 0.1, "stage": "pixels"}, frames)
        assert code == 1008 and messages[-1]["code"] == "unsupported_model", messages
        assert "stage 'pixels'" in messages[-1]["message"] and REFUSAL in messages[-1]["message"]
        assert "toy_whole_frames" in messages[-1]["message"]
        assert server.app.state.service.llm.pipeline.work.tower_passes == passes
        assert httpx.get(f"{server.url}/health").json()["live_sessions"] == 0
        # the one session slot is free again, and after the tower a narration goes on
        messages, code = _narrate(server, start, frames)
        assert code == 1000 and [m["type"] for m in messages].count("segment") == 2
        assert settled_pool_state(server) == (True, 0)


def test_the_python_api_refuses_the_stage_before_any_frame_is_encoded(toy_checkpoint):
    llm = VideoLLM(toy_checkpoint, engine_config=ENGINE_CONFIG)
    refused = f"stage 'pixels'.*toy_whole_frames checkpoints: {REFUSAL}"
    with pytest.raises(ValueError, match=refused):
        next(llm.narrate(_timed(_frames()), PROMPT, stage="pixels"))
    assert llm.pipeline.work.tower_passes == 0


def test_a_gemma3_narration_is_refused_by_what_its_family_does_not_do():
    """Gemma 3 (and Nemotron) refuse the pixel stage, and do not narrate at all: that is the
    error, before anything is encoded."""
    llm = VideoLLM(cached_checkpoint("tiny", family="gemma3"), engine_config=ENGINE_CONFIG)
    with pytest.raises(ValueError, match="'gemma3' models do not narrate"):
        next(llm.narrate(_timed(_frames()), PROMPT, stage="pixels"))
    assert llm.pipeline.work.tower_passes == 0
