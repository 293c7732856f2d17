"""Nemotron 3 Nano Omni configs: both ways of writing the layer stack, the legacy field names,
what is refused (and why), and a checkpoint with the optional parts transformers builds — an
audio branch, multi-token-prediction layers (and the vision norm they bring), latent MoE
projections — loading and answering as transformers does."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from stillcut.engine.cache_groups import AttentionGroup, RecurrentGroup
from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.models.nemotron_omni.text_config import nemotron_text_config
from stillcut.engine.processor import PromptError
from stillcut.engine.request import SamplingParams
from stillcut.vision.pipeline import VisionPipeline

from .nemotron_reference import NemotronReference

AUDIO = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "subsampling_conv_channels": 8,
    "num_mel_bins": 16,
    "projection_hidden_size": 24,
    "projection_bias": False,
}


@pytest.fixture(scope="module")
def config_json():
    path = cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    return json.loads((path / "config.json").read_text())


def _read(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_model_config(tmp_path)


def test_the_legacy_pattern_and_field_names_read_as_the_current_ones(config_json, tmp_path):
    current = _read(tmp_path, config_json)
    legacy = json.loads(json.dumps(config_json))
    text = legacy.pop("text_config")
    kinds = text.pop("layers_block_type")
    text["hybrid_override_pattern"] = "".join(
        {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}[k] for k in kinds
    )
    text["mamba_n_groups"], text["mamba_d_conv"] = text.pop("n_groups"), text.pop("conv_kernel")
    legacy["llm_config"] = text
    legacy["img_context_token_id"] = legacy.pop("image_token_id")
    legacy["video_context_token_id"] = legacy.pop("video_token_id")
    old = _read(tmp_path, legacy)
    assert nemotron_text_config(old) == nemotron_text_config(current)
    assert old.cache_groups == current.cache_groups
    assert (old.image_token_id, old.video_token_id) == (
        current.image_token_id,
        current.video_token_id,
    )
    older_names = ["mamba", "moe", "attention", "mamba", "mlp", "attention"]
    names = dict(config_json, text_config=dict(config_json["text_config"]))
    names["text_config"]["layers_block_type"] = older_names
    assert nemotron_text_config(_read(tmp_path, names)) == nemotron_text_config(current)


def test_the_cache_groups_page_attention_and_keep_mamba2_state(config_json, tmp_path):
    config = _read(tmp_path, config_json)
    attention, recurrent = config.cache_groups
    assert attention == AttentionGroup((2, 5), num_kv_heads=2, head_dim=16)
    conv_dim = 8 * 8 + 2 * 2 * 16  # x, then B and C of 2 groups of 16
    assert recurrent == RecurrentGroup((0, 3), ((conv_dim, 3), (8, 8, 16)), prompt_dependent=True)
    assert config.native_evs_rate == 0.5
    assert _read(tmp_path, dict(config_json, video_pruning_rate=0.0)).native_evs_rate == 0.0
    # its registry entry serves no live sessions (its prompt format has no live form)
    assert "not supported for 'nemotron_h_omni'" in config.live_sessions_refusal


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        ("text_config", "mlp_hidden_act", "gelu", "supported: 'relu2'"),
        ("text_config", "layers_block_type", ["mamba", "conv"], "layer types ['conv']"),
        ("text_config", "layers_block_type", ["mamba", "mlp"], "at least one attention layer"),
        ("vision_config", "use_swiglu_ffn", True, "use_swiglu_ffn=true is not supported"),
        (None, "video_temporal_patch_size", 3, "supported: 2"),
        (None, "downsample_ratio", 0.3, "1 / an integer"),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(
    config_json, tmp_path, section, field, value, message
):
    raw = json.loads(json.dumps(config_json))
    (raw[section] if section else raw)[field] = value
    if field == "video_temporal_patch_size":
        raw["vision_config"][field] = value
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config = _read(tmp_path, raw)
        nemotron_text_config(config)


@pytest.fixture(scope="module")
def optional_parts(tmp_path_factory):
    """A checkpoint with an audio branch, one MTP layer and latent MoE projections, plus a
    stored MTP tensor (transformers skips those)."""
    built = cached_checkpoint(
        "tiny",
        seed=2,
        family="nemotron_h_omni",
        text={"moe_latent_size": 24, "num_nextn_predict_layers": 1},
        extra={"audio_config": AUDIO},
    )
    path = tmp_path_factory.mktemp("nemotron-optional") / "checkpoint"
    shutil.copytree(built, path)
    tensors = load_file(path / "model.safetensors")
    tensors["language_model.mtp.layers.0.norm.weight"] = torch.ones(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_audio_mtp_and_latent_experts_load_and_answer_as_transformers(optional_parts):
    stored = load_file(optional_parts / "model.safetensors")
    assert any(name.startswith("sound_encoder.") for name in stored)
    assert "vision_projector.vision_final_layernorm.weight" in stored
    engine = LLMEngine(
        optional_parts,
        EngineConfig(
            scheduler=SchedulerConfig(max_model_len=512), cache=CacheConfig(num_blocks=64)
        ),
    )
    reference = NemotronReference(optional_parts)
    messages = [{"role": "user", "content": "Describe the weather in the mountains."}]
    prompt = engine.processor.build(messages)
    assert prompt.token_ids == reference.prompt_ids(messages)
    (ours,) = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    assert ours.token_ids == reference.greedy(prompt.token_ids, None, 0.0, 24)

    pipeline = VisionPipeline(optional_parts)
    pixels = torch.randint(0, 256, (48, 80, 3), generator=torch.Generator().manual_seed(4))
    pixels = pixels.to(torch.uint8).numpy()
    prepared = pipeline.media.prepare_image(pixels)
    media = reference.image(prepared.pixel_values, prepared.grid_thw[1:])
    with torch.inference_mode():
        (expected,) = reference.model.get_image_features(
            media["pixel_values"], media["image_grid_hw"]
        ).pooler_output
    torch.testing.assert_close(pipeline.image(pixels).embeds, expected, atol=1e-5, rtol=1e-4)

    audio = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(PromptError, match="allowed text, video, image"):
        engine.processor.build(audio)
