"""Checkpoint loading: config layouts, weight layouts, shards and dtypes, and clear failures."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from stillcut.engine.checkpoint import load_model_config, resolve_checkpoint
from stillcut.engine.loader import (
    CheckpointError,
    canonical_tensor_name,
    checkpoint_tensors,
    load_weights,
)
from stillcut.engine.models.qwen2_vl.entry import QWEN_WEIGHT_PREFIXES
from stillcut.engine.quantization import WeightFormat
from stillcut.vision.towers import load_vision_tower

GRID = (2, 8, 12)
TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 48,
    "out_hidden_size": 32,
    "fullatt_block_indexes": [1],
    "initializer_range": 0.1,
}
TINY_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen2.5-VL (transformers) and the folder of its fp32 single-file save."""
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=TINY_VISION, text_config=TINY_TEXT)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    folder = tmp_path_factory.mktemp("fp32")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def patches():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(GRID[0] * GRID[1] * GRID[2], 3 * 2 * 14 * 14, generator=generator)


def embed(tower, patches):
    with torch.inference_mode():
        return tower.encode([patches], [GRID])[0]


def with_tensors(source, target, tensors):
    """A copy of checkpoint `source` at `target` whose weights are `tensors`."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_sharded_bf16_checkpoint_keeps_its_matrices_in_bf16(tiny, patches, tmp_path):
    """Weights as stored: a bf16 checkpoint's matrices stay bf16 (widened for each product),
    everything else is its bf16 value in float32, and the tower computes what transformers'
    bf16 model upcast to float32 computes; asked for float32, every tensor is float32."""
    model, fp32_folder = tiny
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    bf16_model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    tower = load_vision_tower(tmp_path)
    matrices = {p.dtype for p in tower.parameters() if p.dim() > 1}  # linears, patch conv
    assert matrices == {torch.bfloat16}
    assert {p.dtype for p in tower.parameters() if p.dim() == 1} == {torch.float32}
    ours = embed(tower, patches)
    # Same weights as transformers' bf16 model upcast: equal up to fp32 rounding.
    with torch.inference_mode():
        (theirs,) = (
            bf16_model.float().model.get_video_features(patches, torch.tensor([GRID])).pooler_output
        )
    assert (ours - theirs).abs().max().item() < 1e-4
    widened = load_vision_tower(tmp_path, WeightFormat(torch.float32))
    assert {p.dtype for p in widened.parameters()} == {torch.float32}
    torch.testing.assert_close(embed(widened, patches), ours, atol=1e-5, rtol=1e-5)
    # And close to the fp32 original, within what bf16 weights allow.
    fp32 = embed(load_vision_tower(fp32_folder), patches)
    assert (ours - fp32).abs().max().item() < 0.05 * fp32.abs().max().item()


def test_computing_in_the_stored_dtype_keeps_every_tensor_in_it(tiny, tmp_path):
    """CUDA's way (a GPU computes in the stored dtype): an fp16 checkpoint stays all fp16 (the
    tower is built on the CPU here; only the format's device decides its arithmetic)."""
    model, _ = tiny
    copy.deepcopy(model).to(torch.float16).save_pretrained(tmp_path)
    tower = load_vision_tower(tmp_path, WeightFormat(None, compute_dtype=None, device="cuda"))
    assert {p.dtype for p in tower.parameters()} == {torch.float16}


def test_both_weight_name_layouts_load_the_same(tiny, patches, tmp_path):
    _, folder = tiny
    old_layout = load_file(folder / "model.safetensors")
    assert any(name.startswith("visual.") for name in old_layout)
    new_names = {
        name: (
            "model." + name
            if name.startswith("visual.")
            else name.replace("model.", "model.language_model.", 1)
        )
        for name in old_layout
    }
    new_folder = with_tensors(
        folder, tmp_path / "new", {new_names[n]: t for n, t in old_layout.items()}
    )
    assert any(name.startswith("model.visual.") for name in new_names.values())
    assert checkpoint_tensors(new_folder).keys() == checkpoint_tensors(folder).keys()
    assert torch.equal(
        embed(load_vision_tower(new_folder), patches), embed(load_vision_tower(folder), patches)
    )


def test_canonical_names():
    for stored, canonical in [
        ("model.visual.merger.ln_q.weight", "visual.merger.ln_q.weight"),
        ("visual.merger.ln_q.weight", "visual.merger.ln_q.weight"),
        ("model.language_model.norm.weight", "language_model.norm.weight"),
        ("model.norm.weight", "language_model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]:
        assert canonical_tensor_name(stored, QWEN_WEIGHT_PREFIXES) == canonical


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", r"missing visual\.blocks\.0\.attn\.qkv\.bias; unexpected none"),
        ("extra", r"missing none; unexpected visual\.blocks\.0\.attn\.extra"),
        ("shape", r"visual\.merger\.ln_q\.weight \(33,\) \(expected \(32,\)\)"),
    ],
)
def test_mismatched_weights_name_the_tensor(tiny, tmp_path, change, message):
    _, folder = tiny
    tensors = load_file(folder / "model.safetensors")
    if change == "missing":
        del tensors["visual.blocks.0.attn.qkv.bias"]
    elif change == "extra":
        tensors["visual.blocks.0.attn.extra"] = torch.zeros(2)
    else:
        tensors["visual.merger.ln_q.weight"] = torch.ones(33)
    with pytest.raises(CheckpointError, match=message):
        load_vision_tower(with_tensors(folder, tmp_path / change, tensors))


def test_corrupt_safetensors_names_the_file(tiny, tmp_path):
    _, folder = tiny
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"broken/model\.safetensors"):
        load_vision_tower(broken)


def test_tied_embeddings_need_no_lm_head(tmp_path):
    config = {
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": True,
        "vision_config": TINY_VISION,
        **TINY_TEXT,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    embedding = torch.randn(10, 4)
    save_file({"model.embed_tokens.weight": embedding}, tmp_path / "model.safetensors")
    assert load_model_config(tmp_path).tie_word_embeddings

    def toy_lm(tied: bool) -> nn.Module:
        lm = nn.Module()
        lm.language_model = nn.Module()
        lm.language_model.embed_tokens = nn.Embedding(10, 4)
        lm.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            lm.lm_head.weight = lm.language_model.embed_tokens.weight
        return lm

    lm = toy_lm(tied=True)
    load_weights(lm, tmp_path, prefix="")
    assert lm.lm_head.weight is lm.language_model.embed_tokens.weight
    assert torch.equal(lm.lm_head.weight, embedding)
    with pytest.raises(CheckpointError, match="missing lm_head.weight"):
        load_weights(toy_lm(tied=False), tmp_path, prefix="")


def test_offline_hub_id_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"'Qwen/Qwen2\.5-VL-3B-Instruct'.*local checkpoint"):
        resolve_checkpoint("Qwen/Qwen2.5-VL-3B-Instruct")


def test_local_paths_resolve_or_fail_clearly(tiny, tmp_path):
    _, folder = tiny
    assert resolve_checkpoint(folder) == folder
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "no" / "such" / "model")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_checkpoint(folder / "config.json")


def test_flat_and_nested_config_layouts_parse_the_same(tiny, tmp_path):
    _, folder = tiny
    nested = json.loads((folder / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat |= {k: v for k, v in nested["text_config"].items() if k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    a, b = load_model_config(folder), load_model_config(tmp_path)
    assert a.vision == b.vision
    assert (a.model_type, a.image_token_id, a.video_token_id, a.tie_word_embeddings) == (
        b.model_type,
        b.image_token_id,
        b.video_token_id,
        b.tie_word_embeddings,
    )
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "rope_parameters"):
        assert a.text[key] == b.text[key]
    assert a.vision.fullatt_block_indexes == (1,)
    assert a.vision.window_merged_tokens == 4


def test_original_release_configs(tmp_path):
    qwen2_vl = {
        "model_type": "qwen2_vl",
        "hidden_size": 3584,
        "vision_start_token_id": 151652,
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(qwen2_vl))
    vision = load_model_config(tmp_path).vision
    assert (vision.hidden_size, vision.out_hidden_size, vision.intermediate_size) == (
        1280,
        3584,
        5120,
    )
    assert vision.hidden_act == "quick_gelu" and not vision.has_windows


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "llava"}, "model_type 'llava' is not supported"),
        (
            {"model_type": "qwen2_5_vl", "vision_config": {**TINY_VISION, "num_heads": 3}},
            "hidden_size=32 must be a multiple",
        ),
        ({"model_type": "qwen2_5_vl", "vision_config": {"hidden_size": 32}}, "'depth'"),
        (
            {"model_type": "qwen2_5_vl", "vision_config": {**TINY_VISION, "window_size": 100}},
            "window_size=100",
        ),
    ],
)
def test_bad_configs_fail_clearly(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_model_config(tmp_path)
