"""W8A8 prefill against transformers' fp32 model: within twice the int8 weight-only spread.

The int8 weight-only engine's distance from transformers' fp32 model (the original weights)
on a long prompt is the measured bound's half; the W8A8 engine, whose prefill also quantizes
its activations per token, must land within twice it, and its logits must differ from the
weight-only ones (else its integer path never ran). On Qwen2.5-VL and on Qwen3-VL, whose
video prompt also runs its tower (int8 weights computing in the tower's arithmetic, as every
tower does under w8a8) and the DeepStack sets. It runs with torch's `_int_mm` (no CPU flags
named) and, on Qwen2.5-VL, with each native product this CPU has (`kernels.cpu.gemm`: AMX or
AVX-512).
"""

from __future__ import annotations

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.kernels.cpu import gemm as cpu_gemm
from stillcut.kernels.cpu.packing import is_quads
from stillcut.kernels.cpu_flags import FLAGS_VARIABLE, _proc_cpu_flags
from stillcut.vision.pipeline import VisionPipeline

from .reference import prefill_logits
from .test_compute_dtype_parity import PROMPTS
from .test_precision_parity import FAMILIES, _build


def _engine(path, quantization: str) -> LLMEngine:
    config = EngineConfig(
        quantization=quantization,
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_model_len=512),
        cache=CacheConfig(num_blocks=128, block_size=16),
    )
    return LLMEngine(path, config)


@pytest.mark.parametrize(
    ("family", "case", "flag"),
    [
        ("qwen2_5_vl", "text", ""),
        ("qwen3_vl", "text", ""),
        ("qwen3_vl", "video", ""),
        ("qwen2_5_vl", "text", "amx_int8"),
        ("qwen2_5_vl", "text", "avx512_vnni"),
    ],
)
def test_w8a8_prefill_within_twice_the_int8_spread(monkeypatch, family, case, flag):
    from transformers import AutoModelForImageTextToText

    if flag and flag not in _proc_cpu_flags():
        pytest.skip(f"no {flag} here")
    monkeypatch.setenv(FLAGS_VARIABLE, flag)
    path = cached_checkpoint("tiny", **FAMILIES[family])
    int8, w8a8 = _engine(path, "int8"), _engine(path, "w8a8")
    assert w8a8.weight_format.describe().startswith("w8a8")
    if flag:  # the layout and the flags `linear` takes the native product for
        assert cpu_gemm.chosen_isa("int8") and is_quads(w8a8.model.layers[0].qkv_weight)
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    pipeline = VisionPipeline(path, weight_format=int8.weight_format)
    prompt, hf_inputs = _build((int8, pipeline, None, None, None), PROMPTS[case])
    assert len(prompt.token_ids) > 64
    with torch.inference_mode():
        theirs = reference(**hf_inputs).logits[0]
    weight_only = prefill_logits(int8.model, prompt)
    ours = prefill_logits(w8a8.model, prompt)
    spread = (weight_only - theirs).abs().max().item()
    error = (ours - theirs).abs().max().item()
    print(f"w8a8 ({flag or 'torch'}) {error:.4g}, int8 weight-only {spread:.4g}")
    assert 0 < error <= 2 * spread, (error, spread)
    assert (ours - weight_only).abs().max().item() > 1e-4
