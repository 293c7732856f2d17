"""W8A8 products: a long batch's rows quantized to int8 per token and summed in integers.

`quantization="w8a8"` stores matrices as "int8" does (one scale per output channel,
`engine.quantization`). A batch of more than `matmul.NATIVE_MAX_ROWS` rows (prefill) quantizes
its activations too, dynamically and symmetrically per row: `s_x = max|row| / 127`,
`q_x = round_half_even(x / s_x)` clipped to ±127 (a zero row has scale 0 and q 0); the int8
products are summed exactly in int32 and scaled back by both scales,
`y[n, j] = s_x[n] * s_w[j] * sum_k q_x[n, k] * q_w[k, j]`. Here in torch (`_int_mm`); where the
CPU has integer dot products, the native product (`kernels.cpu_gemm.w8a8_product`: AMX or
AVX-512 VNNI, reading the quad panels) computes the same values bit for bit. Decode keeps the
native step's weight-only product.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from stillcut.engine.quantization import INT8_MAX


class QuantizedRows(NamedTuple):
    """Rows `[N, in]` as int8 `values` and their float32 `scale` `[N]`."""

    values: torch.Tensor
    scale: torch.Tensor


def quantized_rows(x: torch.Tensor) -> QuantizedRows:
    """`x` `[N, in]` quantized per row (see the module docstring)."""
    scale = x.float().abs().amax(dim=1) / INT8_MAX  # [N]
    ratio = (x.float() / scale[:, None]).nan_to_num_(nan=0.0)  # 0 / 0 in a zero row: q = 0
    return QuantizedRows(ratio.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale)


def integer_sums(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """int8 `[N, in]` @ int8 `[in, out]` -> their exact int32 sums `[N, out]`."""
    assert values.dtype == weight.dtype == torch.int8, (values.dtype, weight.dtype)
    return torch._int_mm(values, weight)


def scaled_sums(
    rows: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """float32 `[N, out]`: the integer sums of `rows` and an int8 `weight` `[in, out]`, times
    the rows' and the columns' (`weight_scale` `[out]`) scales."""
    sums = integer_sums(rows.values, weight).float()
    return sums.mul_(rows.scale[:, None]).mul_(weight_scale[None, :])
