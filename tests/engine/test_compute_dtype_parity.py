"""Prefill and the vision tower in bfloat16 arithmetic against transformers' fp32 model.

An engine storing its weights in bfloat16 with `compute_dtype="bfloat16"` runs its long
products (prefill, the tower) as bf16 x bf16 GEMMs. Its reference is transformers' fp32 model
with every parameter rounded to bf16; the bound is measured here: twice the spread transformers'
own bf16 model shows against that fp32 model on the same inputs. Greedy tokens must equal the
fp32 model's `generate` at every step whose top-2 margin exceeds that bound (a step below it may
flip, and the sequences part there). The bf16 run must really differ from the float32 compute
path's (else bf16 arithmetic never ran), and "auto" must pick float32 on a CPU whose flags show
no bfloat16 dot products, computing exactly what `compute_dtype="float32"` computes. A tower
alone is held to the same bound: Qwen3-VL's embeddings and each of its DeepStack sets.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models import matmul
from stillcut.engine.quantization import WeightFormat
from stillcut.engine.request import SamplingParams
from stillcut.kernels.cpu import gemm as cpu_gemm
from stillcut.kernels.cpu_flags import FLAGS_VARIABLE, _proc_cpu_flags
from stillcut.vision.pipeline import VideoInput, VisionPipeline

from .models.qwen3_vl.qwen3_reference import hand_pixels, random_frames
from .reference import hf_greedy_with_margins, prefill_logits
from .test_precision_parity import FAMILIES, _build, _rounded_to_bf16

NUM_NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
STORY = "Write a story about a lighthouse keeper who finds a letter in a bottle on the shore. "
# Longer than the few rows the native product takes: these prefill as long batches.
PROMPTS = {
    "text": [{"type": "text", "text": STORY * 3}],
    "video": [{"type": "video"}, {"type": "text", "text": STORY * 2}],
}


def _engine(path, compute_dtype: str) -> LLMEngine:
    config = EngineConfig(
        dtype="bfloat16",
        compute_dtype=compute_dtype,
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_model_len=512),
        cache=CacheConfig(num_blocks=128, block_size=16),
    )
    return LLMEngine(path, config)


@pytest.fixture(scope="module", params=list(FAMILIES))
def setup(request):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    family = request.param
    path = cached_checkpoint("tiny", **FAMILIES[family])
    engine = _engine(path, "bfloat16")
    pipeline = VisionPipeline(path, weight_format=engine.weight_format)
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    reference = _rounded_to_bf16(reference)
    processor = AutoProcessor.from_pretrained(path) if family == "gemma3" else None
    return engine, pipeline, reference, processor, family


def _hf_logits(model, inputs: dict) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs).logits[0].float()  # [L, vocab]


def _spread(reference, inputs: dict) -> float:
    """How far transformers' own bf16 model lands from its fp32 one on `inputs`."""
    bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    return (_hf_logits(bf16, inputs) - _hf_logits(reference, inputs)).abs().max().item()


def test_prefill_and_tower_compute_in_bfloat16(setup):
    engine, pipeline, _, _, _ = setup
    assert engine.memory.arithmetic.dtype == torch.bfloat16
    assert {p.dtype for p in pipeline.tower.parameters()} == {torch.bfloat16}
    layer = engine.model.layers[0]
    assert all(m.arithmetic == torch.bfloat16 for m in layer.matrices.values())


@pytest.mark.parametrize("case", list(PROMPTS))
def test_bf16_prefill_within_twice_transformers_bf16_spread(setup, case):
    engine, _, reference, _, _ = setup
    prompt, hf_inputs = _build(setup, PROMPTS[case])
    assert len(prompt.token_ids) > 64
    bound = 2 * _spread(reference, hf_inputs)
    theirs = _hf_logits(reference, hf_inputs)
    ours = prefill_logits(engine.model, prompt)
    error = (ours - theirs).abs().max().item()
    print(f"{case}: max |ours - fp32 reference| {error:.4g}, bound {bound:.4g}")
    assert 0 < error <= bound, (error, bound)

    tokens, margins = hf_greedy_with_margins(reference, hf_inputs, NUM_NEW_TOKENS)
    (generated,) = engine.generate([prompt], GREEDY)
    for step, (mine, their, margin) in enumerate(
        zip(generated.token_ids, tokens, margins, strict=True)
    ):
        if mine != their:
            assert margin <= bound, f"step {step}: margin {margin} > {bound}, yet tokens differ"
            break


@pytest.mark.parametrize("flag", ["amx_bf16", "avx512_bf16"])
def test_native_bf16_products_within_the_same_bound(setup, monkeypatch, flag):
    """The native products (`kernels.cpu.gemm`: AMX tiles, or AVX-512 alone) in place of
    torch's, where this CPU has `flag`: the text prompt's prefill within the same bound."""
    if flag not in _proc_cpu_flags():
        pytest.skip(f"no {flag} here")
    engine, _, reference, _, _ = setup
    monkeypatch.setenv(FLAGS_VARIABLE, flag)
    ran = []

    def native(*args, **kwargs):
        product = cpu_gemm.bf16_product(*args, **kwargs)
        ran.append(product is not None)
        return product

    monkeypatch.setattr(matmul, "bf16_product", native)
    prompt, hf_inputs = _build(setup, PROMPTS["text"])
    bound = 2 * _spread(reference, hf_inputs)
    error = (prefill_logits(engine.model, prompt) - _hf_logits(reference, hf_inputs)).abs().max()
    print(f"{flag}: max |ours - fp32 reference| {error.item():.4g}, bound {bound:.4g}")
    assert any(ran) and 0 < error.item() <= bound, (ran, error.item(), bound)


def test_bf16_arithmetic_really_ran(setup):
    """The float32 compute path of the same bf16 weights gives other logits."""
    engine, _, _, _, family = setup
    prompt, _ = _build(setup, PROMPTS["text"])
    fp32 = _engine(cached_checkpoint("tiny", **FAMILIES[family]), "float32")
    moved = prefill_logits(engine.model, prompt) - prefill_logits(fp32.model, prompt)
    assert moved.abs().max().item() > 1e-3


@pytest.mark.parametrize(("flags", "expected"), [("", "float32"), ("avx2 amx_bf16", "bfloat16")])
def test_auto_follows_the_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.setenv(FLAGS_VARIABLE, flags)
    engine = _engine(cached_checkpoint("tiny", **FAMILIES["qwen2_5_vl"]), "auto")
    arithmetic = engine.memory.arithmetic
    assert arithmetic.name == expected
    assert ("CPU has amx_bf16" in arithmetic.reason) == (expected == "bfloat16")


def test_a_cpu_without_bf16_keeps_the_float32_path(monkeypatch):
    """ "auto" without the flags computes bit for bit what compute_dtype="float32" computes."""
    monkeypatch.setenv(FLAGS_VARIABLE, "avx2 fma")
    path = cached_checkpoint("tiny", **FAMILIES["qwen2_5_vl"])
    auto, fp32 = _engine(path, "auto"), _engine(path, "float32")
    prompt = auto.processor.build([{"role": "user", "content": PROMPTS["text"]}], [])
    assert torch.equal(prefill_logits(auto.model, prompt), prefill_logits(fp32.model, prompt))


def _tower_sets(model, frames) -> list[torch.Tensor]:
    """transformers' Qwen3-VL tower on `frames`: the embeddings, then each DeepStack set."""
    patches, grid = hand_pixels(frames)
    with torch.inference_mode():
        out = model.model.get_video_features(
            pixel_values_videos=patches.to(model.dtype), video_grid_thw=torch.tensor([grid])
        )
    return [t.float() for t in (out.pooler_output[0], *(s[0] for s in out.deepstack_features))]


def test_qwen3_tower_and_its_deepstack_sets_within_twice_transformers_bf16_spread():
    from transformers import AutoModelForImageTextToText

    path = cached_checkpoint("tiny", **FAMILIES["qwen3_vl"])
    pipeline = VisionPipeline(path, weight_format=WeightFormat(torch.bfloat16, compute="bfloat16"))
    assert pipeline.weight_format.product_dtype == torch.bfloat16
    frames = random_frames(4, 128, 160, seed=5)
    (item,) = pipeline.encode([VideoInput(frames, frames_fps=2.0)])
    ours = [item.embeds, *(item.features[f"deepstack.{k}"] for k in range(2))]
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    theirs = _tower_sets(_rounded_to_bf16(reference), frames)
    their_bf16 = _tower_sets(copy.deepcopy(reference).to(torch.bfloat16), frames)
    names = ("embeds", "deepstack.0", "deepstack.1")
    for name, mine, fp32, bf16 in zip(names, ours, theirs, their_bf16, strict=True):
        bound = 2 * (bf16 - fp32).abs().max().item()
        error = (mine - fp32).abs().max().item()
        print(f"tower {name}: max |ours - fp32 reference| {error:.4g}, bound {bound:.4g}")
        assert 0 < error <= bound, (name, error, bound)


def test_a_hybrid_model_in_bf16_keeps_its_recurrent_states_fp32():
    """Nemotron's Mamba layers and RADIO tower under bf16 arithmetic: the tower computes in
    bf16, the prefill's products too, and the recurrent states stay float32."""
    path = cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    engine = _engine(path, "bfloat16")
    pipeline = VisionPipeline(path, weight_format=engine.weight_format)
    assert {p.dtype for p in pipeline.tower.parameters()} == {torch.bfloat16}
    states = [t for tensors in engine.runner.recurrent_states.values() for t in tensors]
    assert states and all(t.dtype == torch.float32 for t in states)
    clip = torch.randint(0, 256, (4, 64, 64, 3), dtype=torch.uint8).numpy()
    items = pipeline.encode([VideoInput(clip, frames_fps=2.0)])
    assert items[0].embeds.dtype == torch.float32
    parts = [{"type": "video"}, {"type": "text", "text": STORY * 2}]
    prompt = engine.processor.build([{"role": "user", "content": parts}], items)
    (generated,) = engine.generate([prompt], GREEDY)
    assert len(generated.token_ids) == NUM_NEW_TOKENS
    assert all(t.dtype == torch.float32 for t in states)
