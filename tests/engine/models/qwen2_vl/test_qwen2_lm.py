"""The Qwen2 language model against transformers' Qwen2.5-VL / Qwen2-VL, through the paged cache.

Tiny random checkpoints are built and saved by transformers. Every weight, including the q/k/v
biases and norm scales that transformers initialises to 0 and 1, is redrawn so that a dropped
bias, a swapped projection or a misplaced M-RoPE section changes the logits by far more than
the 1e-4 tolerance. Block tables are scattered so that paging mistakes show.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.loader import CheckpointError, canonical_tensor_name
from stillcut.engine.models.qwen2_vl.config import TextConfig, text_config
from stillcut.engine.models.qwen2_vl.entry import QWEN_WEIGHT_PREFIXES
from stillcut.engine.models.qwen2_vl.model import Qwen2LanguageModel
from stillcut.engine.models.qwen2_vl.positions import MRopeSpec, mrope_positions
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.quantization import WeightFormat
from stillcut.kernels.attention_metadata import AttentionMetadata

TOLERANCE = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 32
VOCAB = 512
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-3,  # far from the default, so that reading it matters
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
}
VISION = {
    "qwen2_5_vl": {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "out_hidden_size": 64,
        "tokens_per_second": 2,
        "fullatt_block_indexes": [0],
    },
    "qwen2_vl": {"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
}
HF_CLASSES = {
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
}
TOKENS_PER_SECOND = {"qwen2_5_vl": 2.0, "qwen2_vl": None}
VARIANTS = [(f, t) for f in HF_CLASSES for t in (True, False)]


def _randomize(model: torch.nn.Module) -> None:
    """Redraw every weight: norms near 1, everything else O(1) after the projections."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1 + 0.2 * noise)
            else:
                param.copy_((0.5 if "embed_tokens" in name else 0.15) * noise)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, tied) -> (transformers model, saved folder)."""
    built = {}
    for family, tied in VARIANTS:
        config_class, model_class = HF_CLASSES[family]
        config = config_class(
            text_config=TEXT,
            vision_config=VISION[family],
            tie_word_embeddings=tied,
            image_token_id=IMAGE_TOKEN,
            video_token_id=VIDEO_TOKEN,
            vision_start_token_id=VISION_START,
            vision_end_token_id=VISION_END,
        )
        torch.manual_seed(0)
        model = model_class(config).eval()
        _randomize(model)
        folder = tmp_path_factory.mktemp(f"{family}-{'tied' if tied else 'untied'}")
        model.save_pretrained(folder)
        built[family, tied] = model, folder
    return built


def _metadata(requests: list[tuple[list[int], int, int]]) -> AttentionMetadata:
    """Metadata of one step; each request is (block ids, tokens already cached, new tokens)."""
    query_lens = [num_new for _, _, num_new in requests]
    seq_lens = [cached + num_new for _, cached, num_new in requests]
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    width = max(len(blocks) for blocks, _, _ in requests)
    slots = [
        blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for blocks, cached, num_new in requests
        for p in range(cached, cached + num_new)
    ]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [blocks + [0] * (width - len(blocks)) for blocks, _, _ in requests], dtype=torch.int32
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def _kv_caches(model: Qwen2LanguageModel) -> list[torch.Tensor]:
    shape = model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
    return [torch.zeros(shape) for _ in range(model.num_layers)]


def _text_positions(start: int, num_tokens: int) -> torch.Tensor:
    return torch.arange(start, start + num_tokens).expand(3, -1)  # [3, num_tokens]


def _video_prompt(seed: int = 0) -> tuple[torch.Tensor, MultiModalItem]:
    """Token ids with one EVS-pruned video (kept tokens out of a 3x2x4 grid) and its item."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.stack(
        torch.meshgrid(torch.arange(3), torch.arange(2), torch.arange(4), indexing="ij"), -1
    ).reshape(-1, 3)  # [24, 3]
    keep = torch.rand(24, generator=generator) < 0.6
    keep[:8] = True  # EVS always keeps the first tubelet
    coords = dense[keep]  # [num_kept, 3]
    item = MultiModalItem(
        kind="video",
        embeds=torch.randn(coords.shape[0], TEXT["hidden_size"], generator=generator),
        coords=coords,
        grid_thw=(3, 4, 8),
        second_per_grid_ts=1.5,
    )
    before = torch.randint(0, 400, (5,), generator=generator).tolist()
    after = torch.randint(0, 400, (4,), generator=generator).tolist()
    ids = before + [VISION_START] + [VIDEO_TOKEN] * item.num_tokens + [VISION_END] + after
    return torch.tensor(ids), item


@torch.inference_mode()
def _hf_logits(hf_model, ids: torch.Tensor, item=None, positions=None) -> torch.Tensor:
    """transformers' logits [N, vocab] for one sequence, video rows replaced by item.embeds."""
    if item is None:
        return hf_model(input_ids=ids[None]).logits[0]
    embeds = hf_model.get_input_embeddings()(ids).clone()  # [N, hidden]
    embeds[ids == VIDEO_TOKEN] = item.embeds
    return hf_model(inputs_embeds=embeds[None], position_ids=positions[:, None]).logits[0]


@torch.inference_mode()
def _our_logits(model, ids, positions, metadata, kv_caches, item_rows=None, mm_embeds=None):
    mm_mask = None if mm_embeds is None else item_rows
    hidden = model(ids, positions, kv_caches, metadata, mm_embeds=mm_embeds, mm_mask=mm_mask)
    return model.compute_logits(hidden)


@pytest.mark.parametrize(("family", "tied"), VARIANTS)
def test_text_prefill_matches_transformers(checkpoints, family, tied):
    hf_model, folder = checkpoints[family, tied]
    model = load_model_config(folder).family.language_model_class().from_checkpoint(folder)
    ids = torch.tensor([3, 17, 250, 9, 9, 411, 42, 7, 88, 120, 5])
    # 11 tokens over three scattered blocks
    metadata = _metadata([([5, 2, 9], 0, ids.numel())])
    logits = _our_logits(model, ids, _text_positions(0, ids.numel()), metadata, _kv_caches(model))
    assert logits.dtype == torch.float32 and logits.shape == (ids.numel(), VOCAB)
    torch.testing.assert_close(logits, _hf_logits(hf_model, ids), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_video_prefill_matches_transformers(checkpoints, family):
    hf_model, folder = checkpoints[family, False]
    model = Qwen2LanguageModel.from_checkpoint(folder)
    ids, item = _video_prompt()
    positions = model.prompt_positions(ids, [item]).positions  # [3, N]
    spec = MRopeSpec(IMAGE_TOKEN, VIDEO_TOKEN, tokens_per_second=TOKENS_PER_SECOND[family])
    assert torch.equal(positions, mrope_positions(ids, [item], spec).positions)
    assert not torch.equal(positions[1], positions[2])  # the sections really differ
    num_tokens = ids.numel()
    blocks = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - -(-num_tokens // BLOCK_SIZE), -1))
    metadata = _metadata([(blocks, 0, num_tokens)])
    logits = _our_logits(
        model, ids, positions, metadata, _kv_caches(model), ids == VIDEO_TOKEN, item.embeds
    )
    expected = _hf_logits(hf_model, ids, item, positions)
    torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=0)


def test_chunked_prefill_and_decode_match_one_forward(checkpoints):
    family = "qwen2_5_vl"
    hf_model, folder = checkpoints[family, True]
    model = Qwen2LanguageModel.from_checkpoint(folder)
    ids, item = _video_prompt(seed=1)
    prompt = model.prompt_positions(ids, [item])
    is_video = ids == VIDEO_TOKEN
    blocks = [7, 3, 12, 0, 21, 9, 15, 4, 30, 1]
    kv_caches = _kv_caches(model)
    split = 6 + item.num_tokens // 2  # inside the video: each chunk scatters part of it
    chunks = []
    for begin, end in ((0, split), (split, ids.numel())):
        rows = is_video[begin:end]
        embeds = item.embeds[is_video[:begin].sum() : is_video[:end].sum()]
        metadata = _metadata([(blocks, begin, end - begin)])
        chunk_ids, chunk_pos = ids[begin:end], prompt.positions[:, begin:end]
        chunks.append(_our_logits(model, chunk_ids, chunk_pos, metadata, kv_caches, rows, embeds))
    tokens, positions = ids.tolist(), [prompt.positions]
    for step in range(4):
        tokens.append(int(chunks[-1][-1].argmax()))
        positions.append(_text_positions(prompt.next_position + step, 1))
        metadata = _metadata([(blocks, len(tokens) - 1, 1)])
        step_ids = torch.tensor(tokens[-1:])
        chunks.append(_our_logits(model, step_ids, positions[-1], metadata, kv_caches))
    expected = _hf_logits(hf_model, torch.tensor(tokens), item, torch.cat(positions, dim=1))
    torch.testing.assert_close(torch.cat(chunks), expected, atol=TOLERANCE, rtol=0)


def test_two_requests_in_one_batch_equal_each_alone(checkpoints):
    family = "qwen2_vl"
    _, folder = checkpoints[family, True]
    model = Qwen2LanguageModel.from_checkpoint(folder)
    text_ids = torch.tensor([11, 12, 13, 14, 15, 16, 17])
    video_ids, item = _video_prompt(seed=2)
    video_pos = model.prompt_positions(video_ids, [item])
    text_blocks, video_blocks = [4, 8], [1, 13, 2, 14, 3, 15, 5, 16]
    requests = [  # (ids, positions, next position, block ids)
        (text_ids, _text_positions(0, text_ids.numel()), text_ids.numel(), text_blocks),
        (video_ids, video_pos.positions, video_pos.next_position, video_blocks),
    ]

    def run(batch: list[int], kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Prefill then one decode step of the requests in `batch`, each as one flat batch."""
        ids = torch.cat([requests[r][0] for r in batch])
        prefill = _metadata([(requests[r][3], 0, requests[r][0].numel()) for r in batch])
        positions = torch.cat([requests[r][1] for r in batch], dim=1)
        embeds = item.embeds if 1 in batch else None
        prefill_logits = _our_logits(
            model, ids, positions, prefill, kv_caches, ids == VIDEO_TOKEN, embeds
        )
        decode = _metadata([(requests[r][3], requests[r][0].numel(), 1) for r in batch])
        decode_ids = torch.tensor([20 + r for r in batch])
        decode_pos = torch.cat([_text_positions(requests[r][2], 1) for r in batch], dim=1)
        decode_logits = _our_logits(model, decode_ids, decode_pos, decode, kv_caches)
        return [prefill_logits, decode_logits]

    together = run([0, 1], _kv_caches(model))
    shared_caches = _kv_caches(model)  # both alone runs share one cache: blocks are disjoint
    alone = [run([0], shared_caches), run([1], shared_caches)]
    torch.testing.assert_close(
        together[0], torch.cat([alone[0][0], alone[1][0]]), atol=TOLERANCE, rtol=0
    )
    torch.testing.assert_close(
        together[1], torch.cat([alone[0][1], alone[1][1]]), atol=TOLERANCE, rtol=0
    )


def test_weights_are_fused_in_the_fast_matvec_layout(checkpoints):
    """What CPU decode speed depends on: float32 [in, out] shapes, contiguous along out when
    out >= in (qkv, gate/up) and along in otherwise (down); the head as 32-column panels
    [vocab / 32, hidden, 32] (each panel its columns' input rows; the panels of a tied model
    are its embedding table too: one vocab copy, its rows gathered from them)."""
    for tied in (True, False):
        model = Qwen2LanguageModel.from_checkpoint(checkpoints["qwen2_5_vl", tied][1])
        layer = model.layers[0]
        assert layer.qkv_weight.shape == (64, (4 + 2 * 2) * 16)
        assert layer.gate_up_weight.shape == (64, 2 * 96) and layer.down_weight.shape == (96, 64)
        assert model.lm_head.shape == (VOCAB // 32, 64, 32)
        for weight in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, model.lm_head):
            assert weight.is_contiguous()
        assert layer.down_weight.T.is_contiguous()
        assert (model.embed_tokens is None) == tied
        ids = torch.tensor([0, 31, 32, VOCAB - 1])
        columns = torch.stack([model.lm_head[i // 32, :, i % 32] for i in ids.tolist()])
        torch.testing.assert_close(model.embed(ids), columns) if tied else None


def _edit_checkpoint(source, target, edit) -> None:
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("tied", "edit", "message"),
    [
        (True, lambda t: t.pop(_name(t, "layers.1.self_attn.k_proj.bias")), r"missing .*k_proj"),
        (False, lambda t: t.pop("lm_head.weight"), r"missing lm_head\.weight"),
        (
            True,
            lambda t: t.update({_name(t, "norm.weight")[:-11] + "layers.0.extra": torch.ones(2)}),
            r"unexpected language_model\.layers\.0\.extra",
        ),
        (
            True,
            lambda t: t.update({_name(t, "norm.weight"): torch.ones(63)}),
            r"wrong tensor shapes: language_model\.norm\.weight",
        ),
    ],
    ids=["missing", "missing_untied_head", "unexpected", "wrong_shape"],
)
def test_checkpoint_mismatch_raises(checkpoints, tmp_path, tied, edit, message):
    broken = tmp_path / "broken"
    _edit_checkpoint(checkpoints["qwen2_5_vl", tied][1], broken, edit)
    with pytest.raises(CheckpointError, match=message):
        Qwen2LanguageModel.from_checkpoint(broken)


def _name(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    """The stored name of the language model tensor ending in `suffix`."""
    (name,) = [
        n
        for n in tensors
        if canonical_tensor_name(n, QWEN_WEIGHT_PREFIXES) == "language_model." + suffix
    ]
    return name


def test_legacy_flat_config_reads_the_same(checkpoints, tmp_path):
    """Older saves keep text fields at the top level and spell M-RoPE `rope_scaling`."""
    folder = checkpoints["qwen2_vl", False][1]
    raw = json.loads((folder / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {
        **raw,
        **text,
        "model_type": "qwen2_vl",
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }
    (tmp_path / "config.json").write_text(json.dumps(flat))
    expected = text_config(load_model_config(folder))
    assert text_config(load_model_config(tmp_path)) == expected
    assert expected.mrope_section == (2, 3, 3) and expected.rms_norm_eps == 1e-3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "mrope_section": [2, 3, 3]}}, "rope type"),
        ({"rope_parameters": {"mrope_section": [2, 3, 4]}}, "mrope_section"),
    ],
)
def test_unsupported_text_config_raises(checkpoints, tmp_path, fields, message):
    raw = json.loads((checkpoints["qwen2_5_vl", True][1] / "config.json").read_text())
    raw["text_config"].update(fields)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        text_config(load_model_config(tmp_path))


# LongRoPE's per-frequency divisors as the demo uses them: a fixed table (8 rotary pairs here),
# some below 1 so that slow frequencies of the h and w sections turn fast.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 1e4,
    "mrope_section": [2, 3, 3],
    "short_factor": [1.0, 1.0, 0.1, 0.5, 3.0, 0.01, 0.2, 1.0],
    "long_factor": [1.0, 1.0, 0.1, 0.5, 3.0, 0.01, 0.2, 1.0],
    "original_max_position_embeddings": 4096,
    "factor": 1.0,
    "attention_factor": 1.0,
}


def test_longrope_video_prefill_matches_transformers(checkpoints, tmp_path):
    """The same weights under LongRoPE factors: transformers' frequencies to the last bit, and
    logits that differ from plain M-RoPE's (the factors are read, not dropped)."""
    plain_model, plain_folder = checkpoints["qwen2_5_vl", False]
    config = plain_model.config.to_dict()
    config["text_config"]["rope_parameters"] = LONGROPE
    config["text_config"]["max_position_embeddings"] = 4096
    hf_model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config)).eval()
    hf_model.load_state_dict(plain_model.state_dict())
    hf_model.save_pretrained(tmp_path)
    model = Qwen2LanguageModel.from_checkpoint(tmp_path)
    hf_rotary = hf_model.model.language_model.rotary_emb
    assert torch.equal(model.rotary.inv_freq, hf_rotary.inv_freq)
    ids, item = _video_prompt()
    positions = model.prompt_positions(ids, [item]).positions
    metadata = _metadata([(list(range(ids.numel() // BLOCK_SIZE + 1)), 0, ids.numel())])
    logits = _our_logits(
        model, ids, positions, metadata, _kv_caches(model), ids == VIDEO_TOKEN, item.embeds
    )
    torch.testing.assert_close(
        logits, _hf_logits(hf_model, ids, item, positions), atol=TOLERANCE, rtol=0
    )
    plain = _hf_logits(plain_model, ids, item, positions)
    assert (logits - plain).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"long_factor": [1.0] * 8}, "short_factor and long_factor must be equal"),
        ({"attention_factor": 1.2}, "attention_factor 1"),
        ({"factor": 2.0, "attention_factor": None}, "attention_factor 1"),
        ({"short_factor": [1.0] * 4, "long_factor": [1.0] * 4}, "rope_factors"),
    ],
)
def test_unsupported_longrope_raises(checkpoints, tmp_path, edit, message):
    raw = json.loads((checkpoints["qwen2_5_vl", True][1] / "config.json").read_text())
    rope = {k: v for k, v in {**LONGROPE, **edit}.items() if v is not None}
    raw["text_config"]["rope_parameters"] = rope
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        text_config(load_model_config(tmp_path))


def test_text_config_names_the_bad_field():
    config = TextConfig(
        vocab_size=8,
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=8,
        mrope_section=(2, 1, 1),
    )
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        replace(config, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_layers=0"):
        replace(config, num_layers=0)


def test_mm_embeds_need_a_mask(checkpoints):
    model = Qwen2LanguageModel.from_checkpoint(checkpoints["qwen2_5_vl", True][1])
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="together"):
        model(ids, _text_positions(0, 2), _kv_caches(model), _metadata([([0], 0, 2)]), ids[:, None])


def test_bfloat16_weights_compute_what_float32_weights_rounded_to_bfloat16_compute(checkpoints):
    """Weights as stored: bf16 matrices (the LM head too) stay bf16 and every product runs in
    float32, so the logits equal, up to float32 rounding, those of float32 weights rounded to
    bf16; a bf16 K/V cache stays near them."""
    folder = checkpoints["qwen2_5_vl", True][1]
    ids = torch.tensor([3, 17, 250, 9, 9, 411, 42])
    metadata = _metadata([([6, 1], 0, ids.numel())])
    stored = Qwen2LanguageModel.from_checkpoint(folder, WeightFormat(torch.bfloat16))
    assert stored.lm_head.dtype == stored.layers[1].down_weight.dtype == torch.bfloat16
    rounded = Qwen2LanguageModel.from_checkpoint(folder, WeightFormat(torch.float32))
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.to(torch.bfloat16))  # in place: as stored, back in float32
    logits = {}
    for name, model, kv_dtype in (
        ("stored", stored, torch.float32),
        ("rounded", rounded, torch.float32),
        ("bf16 kv", stored, torch.bfloat16),
    ):
        kv_caches = [cache.to(kv_dtype) for cache in _kv_caches(model)]
        logits[name] = _our_logits(model, ids, _text_positions(0, 7), metadata, kv_caches)
    assert logits["stored"].dtype == torch.float32
    torch.testing.assert_close(logits["stored"], logits["rounded"], atol=1e-4, rtol=1e-4)
    error = (logits["bf16 kv"] - logits["stored"]).norm() / logits["stored"].norm()
    assert error < 0.01, error
