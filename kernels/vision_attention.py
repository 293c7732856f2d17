"""Variable-length attention over packed vision tokens.

Every vision tower packs the tokens of all its images, frames and windows into one sequence
and describes the segments with `cu_seqlens` (FlashAttention's convention): tokens attend only
within their own segment, with no mask and no padding. `varlen_attention` is the one entry
point all towers call, so a fused GPU kernel can take over here without touching the towers.

On CPU the work goes to torch's `scaled_dot_product_attention`, one batched call per distinct
segment length. Frames of one video share a length, and so do the full windows of a windowed tower,
so a typical layer is one to four calls instead of one call per segment (a Python loop pays
~20 us per call and leaves the second core idle on small windows), and without the
block-diagonal mask of a single call (quadratic in the total token count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Bidirectional attention within each packed segment.

    Args:
        q, k, v: `[total_tokens, num_heads, head_dim]`; any strides with a unit last stride.
        cu_seqlens: `[num_segments + 1]` integer boundaries, from 0 to `total_tokens`,
            non-decreasing (empty segments are allowed and skipped).

    Returns:
        `[total_tokens, num_heads, head_dim]`, contiguous, softmax scale `head_dim ** -0.5`.
    """
    assert q.dim() == 3 and q.shape == k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert cu_seqlens.dim() == 1 and not cu_seqlens.is_floating_point(), cu_seqlens
    bounds = cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == q.shape[0], (bounds[0], bounds[-1], q.shape)
    return _sdpa_by_length(q, k, v, _segment_starts_by_length(bounds))


def _segment_starts_by_length(bounds: list[int]) -> dict[int, list[int]]:
    """Start offsets of the segments, grouped by segment length (empty segments dropped)."""
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        assert end >= start, f"cu_seqlens must be non-decreasing, got {start} then {end}"
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    return starts_by_length


def _sdpa_by_length(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts_by_length: dict[int, list[int]]
) -> torch.Tensor:
    if len(starts_by_length) == 1:
        # One length means the segments tile the whole sequence: attend on views, no gather.
        (length,) = starts_by_length
        return _batched_sdpa(q, k, v, length)
    out = q.new_empty(q.shape)  # [total_tokens, num_heads, head_dim]
    for length, starts in starts_by_length.items():
        if starts[-1] - starts[0] == (len(starts) - 1) * length:
            rows = slice(starts[0], starts[-1] + length)  # adjacent segments: a view
        else:
            first = torch.tensor(starts, device=q.device)[:, None]  # [num_segments, 1]
            rows = (first + torch.arange(length, device=q.device)).flatten()
        out[rows] = _batched_sdpa(q[rows], k[rows], v[rows], length)
    return out


def _batched_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """Attention over consecutive segments of one `length`: `[n * length, H, D]` in and out."""
    # [n * length, H, D] -> [n, H, length, D]; SDPA reads the strided view without a copy.
    q, k, v = (x.unflatten(0, (-1, length)).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)  # [n, H, length, D]
    return out.transpose(1, 2).flatten(0, 1)  # [n * length, H, D]
