"""Qwen3-VL's parts on their own: the config readers, the whole-clip resize (against
transformers' `smart_resize`), which layers are sparse (against transformers' MoE model), the
tubelet times the prompt writes, and the benches' 8B preset (written tensor by tensor)."""

import json
from dataclasses import replace

import pytest
import torch

from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.factory import build_checkpoint
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.models.qwen3_vl.config import read_qwen3_vl, text_config
from stillcut.engine.models.qwen3_vl.preprocess import VIDEO_DEFAULTS, ClipBudget, clip_size
from stillcut.engine.models.qwen3_vl.prompt import tubelet_times
from stillcut.engine.multimodal import MultiModalItem


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe") / "checkpoint"
    return build_checkpoint(folder, family="qwen3_vl_moe")


def _rewrite(folder, tmp_path, **text):
    raw = json.loads((folder / "config.json").read_text())
    raw["text_config"].update(text)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(raw))
    return load_model_config(copy)


@pytest.mark.parametrize(
    ("frames", "height", "width", "low", "high"),
    [
        (4, 128, 160, 16 * 1024, 2048 * 1024),
        (5, 720, 1280, 16 * 1024, 2048 * 1024),  # over budget: shrunk over the whole clip
        (31, 480, 640, 128 * 1024, 768 * 1024),
        (3, 20, 300, 16 * 1024, 2048 * 1024),  # a side under 32 px: scaled up first
        (2, 33, 47, 64 * 1024, 2048 * 1024),  # under budget: grown
    ],
)
def test_the_clip_size_equals_transformers_smart_resize(frames, height, width, low, high):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    config = replace(VIDEO_DEFAULTS, min_pixels=low, max_pixels=high)
    expected = smart_resize(frames, height, width, 2, 32, low, high)
    assert clip_size(frames, height, width, config, ClipBudget()) == expected


def test_a_per_frame_cap_bounds_each_frame_of_a_long_clip():
    config = replace(VIDEO_DEFAULTS, min_pixels=16 * 1024, max_pixels=4096 * 1024)
    free = clip_size(8, 720, 1280, config, ClipBudget())
    capped = clip_size(
        8, 720, 1280, config, ClipBudget(cap_pixels_per_frame=True, max_video_tokens=64)
    )
    assert capped[0] * capped[1] <= 64 * 32 * 32 < free[0] * free[1]


def test_the_sparse_layers_are_those_transformers_gives_experts(moe_folder, tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = _rewrite(moe_folder, tmp_path, decoder_sparse_step=2, mlp_only_layers=[])
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tmp_path / "copy"))
    layers = model.model.language_model.layers
    with_experts = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert text_config(config).sparse_layers == with_experts == (1,)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"head_dim": 12}, "mrope_section"),
    ],
)
def test_the_text_reader_names_what_it_refuses(moe_folder, tmp_path, text, message):
    with pytest.raises(CheckpointError, match=message):
        text_config(_rewrite(moe_folder, tmp_path, **text))


@pytest.mark.parametrize(
    ("vision", "message"),
    [
        ({"num_position_embeddings": 15}, "num_position_embeddings=15"),
        ({"deepstack_visual_indexes": [0, 3]}, "deepstack_visual_indexes"),
    ],
)
def test_the_vision_reader_names_what_it_refuses(moe_folder, vision, message):
    raw = json.loads((moe_folder / "config.json").read_text())
    raw["vision_config"].update(vision)
    with pytest.raises(ValueError, match=message):
        read_qwen3_vl(raw)


def _video(num_frames: int, timestamps: tuple[float, ...]) -> MultiModalItem:
    tubelets = -(-num_frames // 2)
    return MultiModalItem(
        "video",
        torch.zeros(tubelets, 4),
        torch.zeros(tubelets, 3, dtype=torch.long),
        (tubelets, 2, 2),
        second_per_grid_ts=1.0,
        timestamps=timestamps,
    )


def test_a_tubelets_time_is_the_mean_of_its_two_frames():
    # an odd count: the last tubelet's missing frame is its first, repeated
    assert tubelet_times(_video(5, (0.0, 0.5, 1.0, 1.5, 2.0)), 2) == [0.25, 1.25, 2.0]
    # without frame times, tubelet k starts at k seconds per tubelet
    assert tubelet_times(_video(4, ()), 2) == [0.0, 1.0]


def test_the_8b_preset_is_written_tensor_by_tensor_and_loads(tmp_path):
    """Shrunk, the 8B preset's streamed file loads strictly in transformers and in the engine;
    whole, it has Qwen3-VL-8B's parameters and its tower (on the meta device)."""
    from transformers import AutoModelForImageTextToText, Qwen3VLForConditionalGeneration

    from stillcut.engine.factory.checkpoints import checkpoint_spec, hf_config
    from stillcut.engine.llm_engine import LLMEngine
    from stillcut.vision.pipeline import VisionPipeline

    text = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96}
    vision = {"depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48}
    vision |= {"num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1, 2]}
    path = build_checkpoint(tmp_path / "8b", "8b", family="qwen3_vl", text=text, vision=vision)
    _, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    engine = LLMEngine(path)
    assert engine.model.embed_tokens is not None  # untied, as the 8B release
    assert VisionPipeline(path).tower.feature_names == ("deepstack.0", "deepstack.1", "deepstack.2")
    with torch.device("meta"):
        whole = Qwen3VLForConditionalGeneration(hf_config(checkpoint_spec("8b", family="qwen3_vl")))
    num_params = sum(p.numel() for p in whole.parameters()) / 1e9
    tower = whole.model.visual
    assert 8.7 < num_params < 8.8, num_params
    assert (len(tower.blocks), tower.config.hidden_size) == (27, 1152)
    assert list(tower.config.deepstack_visual_indexes) == [8, 16, 24]
