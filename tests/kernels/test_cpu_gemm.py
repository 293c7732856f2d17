"""The native prefill products (`kernels.cpu.gemm`) against torch references, each way this CPU has.

bf16: float32 rows rounded to bfloat16 times a packed bfloat16 weight, against float64 sums of
the same rounded values (float32 accumulation is the only difference allowed). W8A8: the
integer sums equal torch's int64 product exactly (the largest sums there are too), and the
scaled product equals the torch W8A8 path bit for bit. A way this CPU lacks (by
/proc/cpuinfo) is skipped; `STILLCUT_CPU_FLAGS` without the features keeps torch's products.
"""

from __future__ import annotations

import pytest
import torch

from stillcut.engine.models.matmul import _widened_product, linear, stored_matrix
from stillcut.engine.models.w8a8 import quantized_rows, scaled_sums
from stillcut.engine.quantization import quantize_int8
from stillcut.kernels.cpu import gemm as cpu_gemm
from stillcut.kernels.cpu.packing import pack_matrix, pack_quads
from stillcut.kernels.cpu_flags import FLAGS_VARIABLE, _proc_cpu_flags


def _isa(product: str, isa: cpu_gemm.Isa) -> cpu_gemm.Isa:
    flag = cpu_gemm.FEATURES[product, isa][1]
    if flag not in _proc_cpu_flags() or (product, isa) not in cpu_gemm.isas():
        pytest.skip(f"no {flag} here")
    return isa


def _int8_weight(num_in: int, num_out: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight `[in, out]` and its per-column scales."""
    weight, scale = quantize_int8(torch.randn(num_out, num_in, generator=generator), 0)
    return weight.T.contiguous(), scale


@pytest.mark.parametrize("isa", list(cpu_gemm.Isa))
@pytest.mark.parametrize(
    ("rows", "num_in", "num_out", "add"),
    [
        (33, 40, 64, None),
        (100, 72, 96, "bias"),
        (257, 512, 160, "rows"),
        (70, 8, 32, None),
        (1100, 4096, 32, "rows"),  # chunks of 256 rows (of 8 KB): several on each thread
    ],
)
def test_bf16_products_are_float64_sums_of_the_rounded_values(rows, num_in, num_out, add, isa):
    isa = _isa("bf16", isa)
    generator = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, num_in + 24, generator=generator)
    x = wide[:, 5 : 5 + num_in]  # rows apart by more than their width
    weight = torch.randn(num_in, num_out, generator=generator).bfloat16()
    added = {
        None: None,
        "bias": torch.randn(num_out, generator=generator),
        "rows": torch.randn(rows, num_out, generator=generator),
    }[add]
    out = cpu_gemm.bf16_product(x, pack_matrix(weight), added, isa=isa)
    rounded = x.bfloat16().double()
    expected = rounded @ weight.double() + (0 if added is None else added.double())
    magnitude = rounded.abs() @ weight.double().abs()
    assert out.dtype == torch.float32 and out.shape == (rows, num_out)
    assert ((out.double() - expected).abs() <= 1e-5 * magnitude + 1e-6).all()


@pytest.mark.parametrize("isa", list(cpu_gemm.Isa))
@pytest.mark.parametrize(("rows", "num_in", "num_out"), [(40, 2048, 96), (35, 100, 64)])
def test_integer_sums_equal_an_int64_reference_exactly(rows, num_in, num_out, isa):
    isa = _isa("int8", isa)
    generator = torch.Generator().manual_seed(num_in)
    values = torch.randint(-127, 128, (rows, num_in), dtype=torch.int8, generator=generator)
    weight = torch.randint(-127, 128, (num_in, num_out), dtype=torch.int8, generator=generator)
    values[0], weight[:, 0] = 127, -127
    sums = cpu_gemm.int8_sums(values, pack_quads(weight), isa=isa)
    assert torch.equal(sums.long(), values.long() @ weight.long())


@pytest.mark.parametrize("isa", list(cpu_gemm.Isa))
def test_the_largest_integer_sums_stay_exact(isa):
    """65,536 inputs of 127 x -127 and of -127 x -127: the extremes of 32-bit sums the quad
    panels allow (AVX-512's unsigned trick sums 255 x -127 per input before its correction)."""
    isa = _isa("int8", isa)
    num_in = 65536
    values = torch.full((33, num_in), 127, dtype=torch.int8)
    values[1] = -127
    weight = torch.full((num_in, 32), -127, dtype=torch.int8)
    sums = cpu_gemm.int8_sums(values, pack_quads(weight), isa=isa)
    assert torch.equal(sums.long(), values.long() @ weight.long())


@pytest.mark.parametrize("isa", list(cpu_gemm.Isa))
def test_w8a8_product_is_the_torch_path_bit_for_bit(isa):
    isa = _isa("int8", isa)
    generator = torch.Generator().manual_seed(1)
    weight, scale = _int8_weight(136, 96, generator)
    x = torch.randn(75, 136, generator=generator)
    x[3] = 0.0  # a zero row: scale 0, sums 0
    residual = torch.randn(75, 96, generator=generator)
    out = cpu_gemm.w8a8_product(x, pack_quads(weight), scale, residual, isa=isa)
    expected = scaled_sums(quantized_rows(x), weight, scale) + residual
    assert torch.equal(out, expected)


@pytest.mark.parametrize("product", ["bf16", "int8"])
def test_linear_takes_the_native_products_where_the_flags_show_them(monkeypatch, product):
    """A long batch through `linear`: the native product where the flags name the feature,
    torch's (the weight unpacked) where they do not."""
    tiles = cpu_gemm.FEATURES[product, cpu_gemm.Isa.TILES][1] in _proc_cpu_flags()
    isa = _isa(product, cpu_gemm.Isa.TILES if tiles else cpu_gemm.Isa.VECTOR)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(48, 64, generator=generator)
    if product == "bf16":
        packed, scale = pack_matrix(torch.randn(64, 96, generator=generator).bfloat16()), None
        native = cpu_gemm.bf16_product(x, packed, isa=isa)
    else:
        weight, scale = _int8_weight(64, 96, generator)
        packed = pack_quads(weight)
        native = cpu_gemm.w8a8_product(x, packed, scale, isa=isa)
    arithmetic = torch.bfloat16 if product == "bf16" else torch.int8
    matrix = stored_matrix(packed, scale, arithmetic=arithmetic)
    monkeypatch.setenv(FLAGS_VARIABLE, cpu_gemm.FEATURES[product, isa][1])
    assert torch.equal(linear(x, matrix), native)
    monkeypatch.setenv(FLAGS_VARIABLE, "avx2 fma")
    assert torch.equal(linear(x, matrix), _widened_product(x, matrix, None))
    if product == "bf16":  # (W8A8's torch path gives the same values: see above)
        assert not torch.equal(linear(x, matrix), native)


def test_without_the_features_or_the_layout_nothing_runs(monkeypatch):
    monkeypatch.setenv(FLAGS_VARIABLE, "avx2 fma")
    generator = torch.Generator().manual_seed(3)
    weight, scale = _int8_weight(64, 32, generator)
    x = torch.randn(40, 64, generator=generator)
    bf16 = torch.randn(64, 32, generator=generator).bfloat16()
    assert cpu_gemm.w8a8_product(x, pack_quads(weight), scale) is None
    assert cpu_gemm.int8_sums(quantized_rows(x).values, pack_quads(weight)) is None
    assert cpu_gemm.bf16_product(x, pack_matrix(bf16)) is None
    for isa in cpu_gemm.Isa:  # not packed: torch's layouts, whatever the CPU
        assert cpu_gemm.bf16_product(x, bf16, isa=isa) is None
        assert cpu_gemm.w8a8_product(x, weight, scale, isa=isa) is None
