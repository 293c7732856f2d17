"""The compute dtype: validated, detected from the CPU's flags, and part of every cache key."""

from __future__ import annotations

import pytest
import torch

from stillcut.engine.arithmetic import Arithmetic, resolve_arithmetic, salted
from stillcut.engine.config import EngineConfig
from stillcut.engine.quantization import WeightFormat
from stillcut.kernels.cpu_flags import FLAGS_VARIABLE, cpu_flags
from stillcut.vision.pipeline import VisionPipeline


def test_a_bad_compute_dtype_is_refused():
    with pytest.raises(ValueError, match="compute_dtype='float16' must be one of"):
        EngineConfig(compute_dtype="float16")


def test_the_flags_come_from_the_variable_or_proc_cpuinfo(monkeypatch):
    monkeypatch.setenv(FLAGS_VARIABLE, "avx2  amx_bf16 ")
    assert cpu_flags() == {"avx2", "amx_bf16"}
    monkeypatch.delenv(FLAGS_VARIABLE)
    with open("/proc/cpuinfo") as cpuinfo:
        line = next(line for line in cpuinfo if line.startswith("flags"))
    assert cpu_flags() == set(line.partition(":")[2].split())


@pytest.mark.parametrize(
    ("name", "stored", "quantization", "flags", "expected"),
    [
        ("auto", torch.bfloat16, None, "avx512_bf16", torch.bfloat16),
        ("auto", torch.bfloat16, None, "avx2 avx512_vnni", torch.float32),
        ("auto", torch.float32, None, "amx_bf16", torch.float32),
        ("auto", torch.bfloat16, "int8", "amx_bf16", torch.float32),
        ("bfloat16", torch.float32, None, "", torch.bfloat16),
        ("float32", torch.bfloat16, None, "amx_bf16", torch.float32),
    ],
)
def test_auto_needs_bf16_weights_and_bf16_dot_products(
    monkeypatch, name, stored, quantization, flags, expected
):
    monkeypatch.setenv(FLAGS_VARIABLE, flags)
    arithmetic = resolve_arithmetic(name, stored, quantization)
    assert arithmetic.dtype == expected and arithmetic.reason


def test_the_arithmetic_salts_prefixes_and_keys_embeddings(tiny_checkpoint):
    fp32, bf16 = Arithmetic(torch.float32, "a"), Arithmetic(torch.bfloat16, "b")
    assert salted("s", fp32) != salted("s", bf16) and salted(None, fp32) != salted("", fp32)
    keys = {
        VisionPipeline(tiny_checkpoint, weight_format=WeightFormat(compute=name)).model_key
        for name in ("float32", "bfloat16")
    }
    assert len(keys) == 2
