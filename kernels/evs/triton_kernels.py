"""Triton kernels for EVS, the fast path on CUDA (and under TRITON_INTERPRET=1 on CPU).

`pair_dissimilarity_triton` is row-wise `1 - cos(a[i], b[i])`, one program per row: rate mode
runs it on consecutive tubelets, threshold mode with a cap or floor runs it against the
reference. `threshold_stream_triton` is the whole causal threshold step in one kernel, one
program per spatial location walking the pushed tubelets in order: dissimilarity against the
last kept embedding, keep decision (d >= tau) and reference update. It never reads back what
it wrote; it remembers which pushed tubelet was kept last and writes the reference once.
Import this module lazily: it needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stillcut.kernels.evs.config import MAX_DISSIMILARITY
from stillcut.kernels.evs.reference import COSINE_EPS, SUPPORTED_DTYPES

MAX_BLOCK_D = 1024


@triton.jit
def _row_dissimilarity(a_row, b_row, dim, eps, BLOCK_D: tl.constexpr):
    """1 - cos of two rows, accumulated in fp32, norms clamped to eps like torch."""
    cols = tl.arange(0, BLOCK_D)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    a_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_sq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, dim, BLOCK_D):
        in_row = start + cols < dim
        a = tl.load(a_row + start + cols, mask=in_row, other=0.0).to(tl.float32)
        b = tl.load(b_row + start + cols, mask=in_row, other=0.0).to(tl.float32)
        dot += a * b
        a_sq += a * a
        b_sq += b * b
    # Round-to-nearest sqrt/div: the default fast variants are approximate on GPU.
    a_norm = tl.maximum(tl.sqrt_rn(tl.sum(a_sq, axis=0)), eps)
    b_norm = tl.maximum(tl.sqrt_rn(tl.sum(b_sq, axis=0)), eps)
    return 1.0 - tl.div_rn(tl.div_rn(tl.sum(dot, axis=0), a_norm), b_norm)


@triton.jit
def _pair_dissimilarity_kernel(a_ptr, b_ptr, out_ptr, dim, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    out = _row_dissimilarity(a_ptr + row * dim, b_ptr + row * dim, dim, eps, BLOCK_D)
    tl.store(out_ptr + row, out)


@triton.jit
def _threshold_stream_kernel(
    x_ptr,  # [num_tubelets * tokens_per_tubelet, dim]
    ref_ptr,  # [tokens_per_tubelet, dim], same dtype as x
    dissim_ptr,  # [num_tubelets * tokens_per_tubelet] fp32
    keep_ptr,  # [num_tubelets * tokens_per_tubelet] int8
    num_tubelets,
    tokens_per_tubelet,
    dim,
    threshold,
    eps,
    keep_first,
    first_dissim,
    BLOCK_D: tl.constexpr,
):
    location = tl.program_id(0).to(tl.int64)
    ref_row = ref_ptr + location * dim
    last_kept = tl.program_id(0) * 0 - 1  # pushed tubelet kept last here; -1: none yet
    for j in range(num_tubelets):
        token = j * tokens_per_tubelet + location
        kept_token = tl.maximum(last_kept, 0) * tokens_per_tubelet + location
        # The reference is the last kept embedding: this push's if any, else the stored one.
        reference = tl.where(last_kept >= 0, x_ptr + kept_token * dim, ref_row)
        dissim = _row_dissimilarity(x_ptr + token * dim, reference, dim, eps, BLOCK_D)
        is_first = (j == 0) & (keep_first != 0)
        dissim = tl.where(is_first, first_dissim, dissim)
        keep = is_first | (dissim >= threshold)
        tl.store(dissim_ptr + token, dissim)
        tl.store(keep_ptr + token, keep.to(tl.int8))
        last_kept = tl.where(keep, j, last_kept)
    has_new = last_kept >= 0
    kept_row = x_ptr + (tl.maximum(last_kept, 0) * tokens_per_tubelet + location) * dim
    cols = tl.arange(0, BLOCK_D)
    for start in range(0, dim, BLOCK_D):
        copy = (start + cols < dim) & has_new
        value = tl.load(kept_row + start + cols, mask=copy)
        tl.store(ref_row + start + cols, value, mask=copy)


def _block_d(dim: int) -> int:
    return min(MAX_BLOCK_D, triton.next_power_of_2(dim))


def _check_rows(name: str, rows: torch.Tensor) -> None:
    assert rows.dim() == 2, f"{name}: expected [rows, dim], got {tuple(rows.shape)}"
    assert rows.dtype in SUPPORTED_DTYPES, f"{name}: dtype {rows.dtype} not in {SUPPORTED_DTYPES}"
    assert rows.is_contiguous(), f"{name}: must be contiguous, strides {rows.stride()}"


def _check_out(name: str, out: torch.Tensor, num_rows: int, device: torch.device) -> None:
    assert out.shape == (num_rows,), f"{name}: expected [{num_rows}], got {tuple(out.shape)}"
    assert out.dtype == torch.float32 and out.is_contiguous(), (name, out.dtype, out.stride())
    assert out.device == device, (name, out.device, device)


def pair_dissimilarity_triton(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Row-wise `1 - cos(a[i], b[i])` in fp32; `a`, `b` contiguous `[rows, dim]`, same dtype."""
    _check_rows("a", a)
    _check_rows("b", b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert a.device == b.device, (a.device, b.device)
    num_rows, dim = a.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.float32, device=a.device)
    _check_out("out", out, num_rows, a.device)
    if num_rows > 0:
        _pair_dissimilarity_kernel[(num_rows,)](a, b, out, dim, COSINE_EPS, BLOCK_D=_block_d(dim))
    return out


def threshold_stream_triton(
    embeds: torch.Tensor, reference: torch.Tensor, threshold: float, keep_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal threshold pruning of `n` tubelets; updates `reference` in place.

    `embeds` is `[n * locations, dim]`, `reference` `[locations, dim]` (same dtype). With
    `keep_first` the first tubelet is kept whole and reports dissimilarity 2.0. Returns the
    fp32 dissimilarity and the bool keep mask, both `[n * locations]`.
    """
    _check_rows("embeds", embeds)
    _check_rows("reference", reference)
    num_locations, dim = reference.shape
    assert embeds.shape[1] == dim and embeds.shape[0] % num_locations == 0, (
        embeds.shape,
        reference.shape,
    )
    assert embeds.dtype == reference.dtype, (embeds.dtype, reference.dtype)
    assert embeds.device == reference.device, (embeds.device, reference.device)
    num_tokens = embeds.shape[0]
    dissimilarity = torch.empty(num_tokens, dtype=torch.float32, device=embeds.device)
    keep = torch.empty(num_tokens, dtype=torch.int8, device=embeds.device)
    _threshold_stream_kernel[(num_locations,)](
        embeds,
        reference,
        dissimilarity,
        keep,
        num_tokens // num_locations,
        num_locations,
        dim,
        float(threshold),
        COSINE_EPS,
        int(keep_first),
        MAX_DISSIMILARITY,
        BLOCK_D=_block_d(dim),
    )
    return dissimilarity, keep.view(torch.bool)
