"""A family registered from a test, without editing stillcut: flags unlike Qwen's are honoured.

The throwaway family reuses the Qwen2.5-VL language model, tower and tokenizer under another
`model_type`, but has no video token (videos are written as image items, one per tubelet), no
live sessions, and bidirectional image items. Its images must attend both ways exactly as
transformers' Qwen2.5-VL does when handed the mask "causal OR same image"; a live session is
refused with a clear message; describing a video writes it the family's way.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from websockets.sync.client import connect

from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.models.families import FAMILIES
from stillcut.engine.models.qwen2_vl.checkpoint import VIDEO_TOKEN_ID
from stillcut.engine.models.qwen2_vl.config import read_qwen2_5_vl
from stillcut.engine.models.qwen2_vl.entry import QWEN2_5_VL
from stillcut.engine.request import SamplingParams
from stillcut.service.api import VideoLLM
from stillcut.service.config import ServerConfig
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline

from .conftest import running_server

MODEL_TYPE = "toy_bidirectional"
ENGINE_CONFIG = EngineConfig(
    scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048),
    cache=CacheConfig(num_blocks=256, block_size=16),
)


def _read_without_video_token(raw):
    read = read_qwen2_5_vl(raw)
    return dataclasses.replace(
        read, token_ids=dataclasses.replace(read.token_ids, video_token_id=None)
    )


TOY = dataclasses.replace(
    QWEN2_5_VL,
    model_type=MODEL_TYPE,
    read_config=_read_without_video_token,
    has_video_token=False,
    live_sessions=False,
    narration_timestamp=None,
    bidirectional_items=True,
    native_evs_rate=lambda raw: float(raw["video_pruning_rate"]),
)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory):
    """The tiny Qwen2.5-VL checkpoint, relabelled as the throwaway family, which is registered
    for the module's tests only."""
    folder = tmp_path_factory.mktemp("toy") / "checkpoint"
    shutil.copytree(cached_checkpoint("tiny", seed=1), folder)
    config = json.loads((folder / "config.json").read_text())
    relabelled = {**config, "model_type": MODEL_TYPE, "video_pruning_rate": 0.6}
    (folder / "config.json").write_text(json.dumps(relabelled))
    with FAMILIES.registered(TOY):
        yield folder


def test_config_and_flags_come_from_the_entry(toy_checkpoint, tmp_path):
    config = load_model_config(toy_checkpoint)
    assert config.family is TOY and config.video_token_id is None
    assert config.native_evs_rate == 0.6  # the checkpoint's own rate, as the entry reads it
    assert load_model_config(cached_checkpoint("tiny", seed=1)).native_evs_rate is None
    # an entry whose positions kind disagrees with its language model is refused at start
    one_d = shutil.copytree(toy_checkpoint, tmp_path / "one_d")
    config = json.loads((one_d / "config.json").read_text())
    (one_d / "config.json").write_text(json.dumps({**config, "model_type": "toy_1d"}))
    with FAMILIES.registered(dataclasses.replace(TOY, model_type="toy_1d", positions="1d")):
        with pytest.raises(CheckpointError, match="declares '1d' positions.* takes 3"):
            LLMEngine(one_d, ENGINE_CONFIG)


def test_images_attend_bidirectionally_as_transformers_does_with_that_mask(toy_checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    engine = LLMEngine(toy_checkpoint, ENGINE_CONFIG)
    pipeline = VisionPipeline(toy_checkpoint)
    image = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    (item,) = pipeline.encode([ImageInput(image)])
    assert item.bidirectional and item.num_tokens > 1
    prompt = engine.processor.build_text("What is this?", [item])
    hidden = _prefill_hidden_states(engine, prompt)  # [prompt_len, hidden]

    original = cached_checkpoint("tiny", seed=1)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(original).eval()
    place = prompt.mm_positions[0]
    embeds = reference.get_input_embeddings()(torch.tensor([prompt.token_ids]))
    embeds[0, place.offset : place.end] = item.embeds
    positions, _ = engine.model.prompt_positions(torch.tensor(prompt.token_ids), prompt.items)
    both_ways = _reference_states(reference, embeds, positions, (place.offset, place.end))
    causal = _reference_states(reference, embeds, positions, None)
    torch.testing.assert_close(hidden, both_ways, atol=1e-4, rtol=1e-4)
    image = slice(place.offset, place.end)
    # the first image token sees the whole image: far from what causal attention gives it
    assert (both_ways[image] - causal[image]).abs().max() > 0.1


def _prefill_hidden_states(engine: LLMEngine, prompt) -> torch.Tensor:
    """The engine's final hidden states of the whole prompt, read off its one prefill step."""
    seen = []
    forward = engine.model.forward
    engine.model.forward = lambda *args, **kwargs: seen.append(forward(*args, **kwargs)) or seen[-1]
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1))
    finally:
        del engine.model.forward
    assert seen[0].shape[0] == len(prompt.token_ids)  # all of it in one step
    return seen[0]


def _reference_states(reference, embeds, positions, block) -> torch.Tensor:
    """transformers' final hidden states [prompt_len, hidden] with the mask causal OR `block`."""
    length = embeds.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    if block is not None:
        allowed[block[0] : block[1], block[0] : block[1]] = True
    mask = torch.zeros(1, 1, length, length).masked_fill(~allowed, float("-inf"))
    with torch.inference_mode():
        out = reference.model(
            inputs_embeds=embeds, position_ids=positions[:, None, :], attention_mask=mask
        )
    return out.last_hidden_state[0]


def test_describe_writes_a_video_as_one_bidirectional_image_per_tubelet(toy_checkpoint):
    llm = VideoLLM(toy_checkpoint, engine_config=ENGINE_CONFIG)
    frames = np.random.default_rng(1).integers(0, 256, (6, 56, 84, 3), dtype=np.uint8)
    result = llm.describe(frames, "What happens?", evs=None, max_tokens=4, frames_fps=2.0)
    assert result.finish_reason == "length" and len(result.token_ids) == 4
    (item,) = llm.encode([VideoInput(frames, evs=None, frames_fps=2.0)])
    prompt = llm.processor.build_text("What happens?", [item])
    assert VIDEO_TOKEN_ID not in prompt.token_ids  # written as images, not as a video
    assert [i.kind for i in prompt.items] == ["video"] * 3  # one item per tubelet (6 frames)
    assert all(i.bidirectional and i.grid_thw[0] == 1 for i in prompt.items)
    assert prompt.token_ids.count(llm.processor.special.image_token_id) == item.num_tokens
    assert result.usage.prompt_tokens == len(prompt.token_ids)


def test_a_live_session_is_refused_with_a_clear_message(toy_checkpoint):
    with running_server(toy_checkpoint, ServerConfig()) as server:
        url = server.url.replace("http://", "ws://") + "/v1/stream"
        with connect(url, proxy=None) as socket:
            socket.send(json.dumps({"type": "start", "threshold": 0.1, "fps": 2.0}))
            error = json.loads(socket.recv(timeout=30))
    assert error["type"] == "error" and error["code"] == "unsupported_model"
    assert f"live sessions are not supported for {MODEL_TYPE!r} checkpoints" in error["message"]
