"""Our Gemma 3 vision encoder (SigLIP tower + projector) against transformers' own.

Tiny random Gemma 3 models are built and saved by transformers, loaded by our loader, and both
encode the same pixels; outputs must agree to 1e-4 in fp32. Every weight is redrawn at a
scale where a wrong norm, pooling order or position would show (transformers starts Gemma's
RMSNorm scales and the projector at zero). The loader must read the Gemma 3 config, and the
weight names of every layout Gemma 3 checkpoints are saved in, to the same tensors.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.loader import CheckpointError, canonical_tensor_name, checkpoint_tensors
from stillcut.engine.models.gemma3.entry import GEMMA3
from stillcut.engine.models.gemma3.tower import Gemma3VisionEncoder
from stillcut.engine.models.qwen2_vl.config import text_config
from stillcut.vision.towers import load_vision_tower

TOLERANCE = 1e-4
TEXT = {
    "vocab_size": 64,
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
}
# (image_size, patch_size, mm_tokens_per_image, vision fields): 2x2 and 4x4 pooling windows.
VARIANTS = {
    "pool2": (64, 8, 16, {"num_hidden_layers": 2, "num_attention_heads": 2}),
    "pool4_gelu": (
        48,
        6,
        4,
        {"num_hidden_layers": 1, "num_attention_heads": 4, "hidden_act": "gelu"},
    ),
}


def build_model(variant: str) -> Gemma3ForConditionalGeneration:
    image_size, patch_size, mm_tokens, vision = VARIANTS[variant]
    config = Gemma3Config(
        text_config=TEXT,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "image_size": image_size,
            "patch_size": patch_size,
            "vision_use_head": False,
            **vision,
        },
        mm_tokens_per_image=mm_tokens,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:  # LayerNorm weights around 1, Gemma RMSNorm `1 + w` around 0
                param.copy_((0.0 if "soft_emb" in name else 1.0) + 0.2 * noise)
            else:
                param.copy_(0.15 * noise)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(transformers model, folder of its save, our encoder loaded from it)."""
    model = build_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder, load_vision_tower(folder)


def random_images(model: Gemma3ForConditionalGeneration, count: int, seed: int) -> torch.Tensor:
    size = model.config.vision_config.image_size
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(count, 3, size, size, generator=generator) * 2 - 1  # [B, 3, S, S]


@torch.inference_mode()
def test_batch_matches_transformers(checkpoint):
    model, _, encoder = checkpoint
    images = random_images(model, count=3, seed=0)
    theirs = model.model.get_image_features(images).pooler_output
    ours = encoder.encode(images)
    config = model.config
    assert ours.shape == (3, config.mm_tokens_per_image, config.text_config.hidden_size)
    assert theirs.abs().max() > 0.5  # the tolerance means something
    assert (ours - theirs).abs().max().item() < TOLERANCE
    # Each image is encoded on its own: batching changes nothing, images differ.
    alone = encoder.encode(images[1:2])
    assert (alone[0] - ours[1]).abs().max().item() < TOLERANCE
    assert (ours[0] - ours[1]).abs().max() > 0.1


def test_model_config_reads_the_vision_side(checkpoint):
    model, folder, encoder = checkpoint
    config = load_model_config(folder)
    vision = config.vision
    hf_vision = model.config.vision_config
    assert config.model_type == "gemma3" and encoder.config == vision
    assert (vision.hidden_size, vision.num_layers, vision.num_heads) == (
        hf_vision.hidden_size,
        hf_vision.num_hidden_layers,
        hf_vision.num_attention_heads,
    )
    assert (vision.image_size, vision.patch_size) == (hf_vision.image_size, hf_vision.patch_size)
    assert vision.mm_tokens_per_image == model.config.mm_tokens_per_image
    assert vision.out_hidden_size == TEXT["hidden_size"]
    assert vision.pool_kernel * vision.tokens_per_side == vision.patches_per_side
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (
        262144,
        255999,
        256000,
    )
    assert config.video_token_id is None and config.tie_word_embeddings
    with pytest.raises(CheckpointError, match="sliding-window"):
        text_config(config)  # the Qwen2 language model must refuse it


# transformers 5.24 saves `vision_tower.*` (no `vision_model.`), `multi_modal_projector.*` and
# `language_model.model.*`; the other layouts rename those prefixes.
SAVED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "language_model.model.")
LAYOUTS = {
    "hub_release": (
        "vision_tower.vision_model.",
        "multi_modal_projector.",
        "language_model.model.",
    ),
    "transformers_4": (
        "model.vision_tower.vision_model.",
        "model.multi_modal_projector.",
        "model.language_model.",
    ),
    "module_names": (
        "model.vision_tower.",
        "model.multi_modal_projector.",
        "model.language_model.",
    ),
}


def _rename(name: str, layout: str) -> str:
    for saved, stored in zip(SAVED_PREFIXES, LAYOUTS[layout], strict=True):
        if name.startswith(saved):
            return stored + name[len(saved) :]
    raise AssertionError(f"unexpected saved tensor {name}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@torch.inference_mode()
def test_every_weight_layout_loads_the_same(checkpoint, tmp_path, layout):
    model, folder, encoder = checkpoint
    saved = load_file(folder / "model.safetensors")
    assert any(name.startswith("vision_tower.embeddings.") for name in saved)
    renamed = {_rename(name, layout): tensor for name, tensor in saved.items()}
    head = set() if layout == "hub_release" else {"lm_head.weight"}  # the others store it too
    if head:
        renamed["lm_head.weight"] = saved["language_model.model.embed_tokens.weight"].clone()
    if layout == "module_names":
        assert set(renamed) == set(model.state_dict())
    (tmp_path / "ckpt").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "ckpt" / "config.json")
    save_file(renamed, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_tensors(tmp_path / "ckpt").keys() == checkpoint_tensors(folder).keys() | head
    images = random_images(model, count=2, seed=3)
    assert torch.equal(load_vision_tower(tmp_path / "ckpt").encode(images), encoder.encode(images))


@pytest.mark.parametrize(
    ("stored", "canonical"),
    [
        (
            "vision_tower.vision_model.post_layernorm.bias",
            "visual.vision_tower.post_layernorm.bias",
        ),
        (
            "vision_tower.encoder.layers.0.mlp.fc1.weight",
            "visual.vision_tower.encoder.layers.0.mlp.fc1.weight",
        ),
        ("model.vision_tower.vision_model.embeddings.x", "visual.vision_tower.embeddings.x"),
        ("model.vision_tower.embeddings.x", "visual.vision_tower.embeddings.x"),
        (
            "multi_modal_projector.mm_soft_emb_norm.weight",
            "visual.multi_modal_projector.mm_soft_emb_norm.weight",
        ),
        (
            "model.multi_modal_projector.mm_input_projection_weight",
            "visual.multi_modal_projector.mm_input_projection_weight",
        ),
        (
            "language_model.model.layers.0.self_attn.q_norm.weight",
            "language_model.layers.0.self_attn.q_norm.weight",
        ),
        ("model.language_model.norm.weight", "language_model.norm.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_canonical_gemma3_names(stored, canonical):
    assert canonical_tensor_name(stored, GEMMA3.weight_prefixes) == canonical


def test_release_config_takes_transformers_defaults(tmp_path):
    # The shape of a real release's config.json: most SigLIP fields and the ids are omitted.
    release = {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "model_type": "gemma3_text"},
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(release))
    config = load_model_config(tmp_path)
    vision = config.vision
    assert (vision.mm_tokens_per_image, vision.patches_per_side, vision.pool_kernel) == (256, 64, 4)
    assert (vision.hidden_act, vision.layer_norm_eps, vision.in_channels) == (
        "gelu_pytorch_tanh",
        1e-6,
        3,
    )
    assert (vision.head_dim, vision.out_hidden_size) == (72, 2560)
    assert config.image_token_id == 262144
    release |= {"image_token_id": 5, "boi_token_index": 3, "eoi_token_index": 4}
    (tmp_path / "config.json").write_text(json.dumps(release))
    config = load_model_config(tmp_path)
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (
        5,
        3,
        4,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"image_size": 60}, "image_size=60 must be a multiple of patch_size=8"),
        ({"num_attention_heads": 3}, "multiple of num_heads=3"),
        ({"mm_tokens_per_image": 15}, "mm_tokens_per_image=15 must be a square"),
        ({"mm_tokens_per_image": 9}, "mm_tokens_per_image=9 must be a square"),
    ],
)
def test_bad_gemma3_configs_fail_clearly(tmp_path, change, message):
    vision = {
        "hidden_size": 32,
        "num_attention_heads": 2,
        "image_size": 64,
        "patch_size": 8,
        "vision_use_head": False,
    }
    top = {"model_type": "gemma3", "text_config": {"hidden_size": 32}, "mm_tokens_per_image": 16}
    for key, value in change.items():
        (top if key == "mm_tokens_per_image" else vision)[key] = value
    (tmp_path / "config.json").write_text(json.dumps({**top, "vision_config": vision}))
    with pytest.raises(CheckpointError, match=message):
        load_model_config(tmp_path)


def test_encode_rejects_wrong_pixel_shapes(checkpoint):
    model, _, encoder = checkpoint
    assert isinstance(encoder, Gemma3VisionEncoder)
    size = model.config.vision_config.image_size
    for shape in [(3, size, size), (0, 3, size, size), (1, 3, size, size + 1), (1, 1, size, size)]:
        with pytest.raises(ValueError, match="pixel_values shape"):
            encoder.encode(torch.zeros(shape))
