"""Torch references for EVS: the row-wise cosine dissimilarity of the hot loop, and the
published rate rule as written (`published_rate_mask`), the yardstick of tests and benches.

`1 - cos` follows `torch.nn.functional.cosine_similarity` (each norm clamped to eps, so a zero
vector has cosine 0) but is computed as `dot / |a| / |b|` in row chunks of a few MiB: the
embeddings stream from RAM once, the second operand and the product buffer stay in cache, and
no full-size temporary is allocated. Every row goes through the same reductions, so equal
inputs give bit-identical dissimilarities wherever they sit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COSINE_EPS = 1e-8  # torch.nn.functional.cosine_similarity's default
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CHUNK_BYTES = 4 << 20  # a chunk and its product buffer stay in L3; few enough torch calls


def pair_dissimilarity_torch(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Return `1 - cosine_similarity(a[i], b[i])` for every row, in float32.

    `a` and `b` are `[num_rows, dim]` in fp32, fp16 or bf16; `out` (optional) is a float32
    `[num_rows]` tensor to write into.
    """
    assert a.dim() == 2 and a.shape == b.shape, (a.shape, b.shape)
    num_rows, dim = a.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.float32, device=a.device)
    assert out.shape == (num_rows,) and out.dtype == torch.float32, (out.shape, out.dtype)
    rows_per_chunk = max(2, CHUNK_BYTES // (4 * dim))
    norm_a = torch.empty(num_rows, dtype=torch.float32, device=a.device)  # [num_rows]
    norm_b = torch.empty_like(norm_a)  # [num_rows]
    product = torch.empty(
        min(rows_per_chunk + 1, num_rows), dim, dtype=torch.float32, device=a.device
    )
    for start, stop in _chunk_bounds(num_rows, rows_per_chunk):
        a_chunk = a[start:stop].float()  # [rows, dim]; no copy for fp32
        b_chunk = b[start:stop].float()  # [rows, dim]
        torch.linalg.vector_norm(a_chunk, dim=-1, out=norm_a[start:stop])
        torch.linalg.vector_norm(b_chunk, dim=-1, out=norm_b[start:stop])
        chunk_product = product[: stop - start]  # [rows, dim]
        torch.mul(a_chunk, b_chunk, out=chunk_product)
        torch.sum(chunk_product, dim=-1, out=out[start:stop])  # dot products
    # Two divisions instead of dividing by |a|*|b|: the product of two large norms can overflow.
    out.div_(norm_a.clamp_min_(COSINE_EPS)).div_(norm_b.clamp_min_(COSINE_EPS))
    return out.neg_().add_(1.0)


def _chunk_bounds(num_rows: int, rows_per_chunk: int) -> list[tuple[int, int]]:
    # No lone last row: torch splits a single long row's reduction across threads, which
    # would round it differently from an equal row elsewhere.
    starts = list(range(0, num_rows, rows_per_chunk)) or [0]
    if len(starts) > 1 and num_rows - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [num_rows], strict=True))


def published_rate_mask(
    embeds: torch.Tensor, grid: tuple[int, int, int], rate: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `compute_retention_mask`, transcribed step by step (cosine_similarity, cat with a
    255 sentinel for the first tubelet, stable argsort, mask), with its clip-sized temporaries.

    `embeds` `[t * h * w, dim]` -> the kept mask `[t * h * w]` bool and the ranked
    dissimilarities `[t * h * w]`.
    """
    t, h, w = grid
    video = embeds.reshape(t, h, w, embeds.shape[-1])
    dissimilarity = 1 - F.cosine_similarity(video[1:], video[:-1], dim=-1)
    dissimilarity = torch.cat([255 * torch.ones_like(video[:1, :, :, 0]), dissimilarity], dim=0)
    flat = dissimilarity.view(-1)
    order = torch.argsort(flat, dim=-1, descending=True, stable=True)
    count = max(h * w, int(t * h * w * (1 - rate)))
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[order[:count]] = True
    return mask, flat
