"""W8A8 products: rows quantized per token by the rule, integer sums exact against int64.

The rule is written here again from its statement (`s_x = max|row| / 127`, round half to
even, clipped to ±127), not taken from the engine; the sums are checked against torch's int64
product of the same int8 values, and `linear` of a long batch against the scaled int64 sums,
for every layout an int8 weight is stored in (plain, packed tiles, quad panels); a short batch
keeps the weight-only product.
"""

from __future__ import annotations

import pytest
import torch

from stillcut.engine.models.matmul import NATIVE_MAX_ROWS, linear, stored_matrix
from stillcut.engine.models.w8a8 import integer_sums, quantized_rows
from stillcut.engine.quantization import dense, quantize_int8
from stillcut.kernels.cpu.packing import pack_matrix, pack_quads


def _rule(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(scale > 0, x / scale, torch.zeros_like(x))
    return torch.round(q).clamp(-127, 127).to(torch.int8), scale[:, 0]


def test_rows_are_quantized_by_the_rule():
    x = torch.randn(40, 72)
    x[3] = 0.0  # a zero row: scale 0, q 0
    x[5, :4] = torch.tensor([2.5, -2.5, 1.5, 127.0]) * (x[5].abs().max() / 127)
    rows = quantized_rows(x)
    expected_values, expected_scale = _rule(x)
    assert torch.equal(rows.values, expected_values)
    assert torch.equal(rows.scale, expected_scale)


def test_integer_sums_equal_an_int64_reference_exactly():
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-127, 128, (40, 2048), dtype=torch.int8, generator=generator)
    weight = torch.randint(-127, 128, (2048, 96), dtype=torch.int8, generator=generator)
    values[0], weight[:, 0] = 127, -127  # the largest sums there are
    sums = integer_sums(values, weight)
    assert torch.equal(sums.long(), values.long() @ weight.long())


@pytest.mark.parametrize("layout", ["plain", "tiles", "quads"])
def test_a_long_batch_is_the_scaled_integer_sum_and_a_short_one_weight_only(layout):
    num_in, num_out = 64, 96
    weight, scale = quantize_int8(torch.randn(num_out, num_in), 0)
    weight = weight.T.contiguous()  # [in, out]
    stored = {"plain": weight, "tiles": pack_matrix(weight), "quads": pack_quads(weight)}[layout]
    matrix = stored_matrix(stored, scale, arithmetic=torch.int8)
    x = torch.randn(NATIVE_MAX_ROWS + 8, num_in)
    values, row_scale = _rule(x)
    exact = (values.long() @ weight.long()).double() * row_scale[:, None] * scale[None, :]
    torch.testing.assert_close(linear(x, matrix).double(), exact, rtol=1e-6, atol=1e-6)
    short = x[:NATIVE_MAX_ROWS]
    weight_only = short @ dense(weight, scale, 1, torch.float32)
    torch.testing.assert_close(linear(short, matrix), weight_only, rtol=1e-5, atol=1e-5)
