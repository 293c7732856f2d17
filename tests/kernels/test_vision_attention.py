"""varlen_attention against plain attention computed one segment at a time."""

from __future__ import annotations

import pytest
import torch

from stillcut.kernels.vision_attention import varlen_attention

NUM_HEADS, HEAD_DIM = 2, 8


def reference(q, k, v, lengths):
    """Softmax attention written out per segment, no SDPA."""
    outputs, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * HEAD_DIM**-0.5
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[rows]))
        start += length
    return torch.cat(outputs)


@pytest.mark.parametrize(
    "lengths",
    [
        [16],  # one image
        [12, 12, 12],  # frames of one video: one batched call on views
        [16, 8, 16, 8, 4],  # windows of a frame with a partial edge: gathered by length
        [6, 6, 10, 10, 3],  # adjacent runs of equal length
        [5, 0, 7],  # empty segment
    ],
)
def test_matches_per_segment_attention(lengths):
    generator = torch.Generator().manual_seed(sum(lengths))
    qkv = torch.randn(sum(lengths), 3, NUM_HEADS, HEAD_DIM, generator=generator)
    q, k, v = qkv.unbind(1)  # strided views, as the towers pass them
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu_seqlens)
    assert out.shape == q.shape
    assert (out - reference(q, k, v, lengths)).abs().max().item() < 1e-5


def test_segments_do_not_leak():
    q = torch.randn(8, NUM_HEADS, HEAD_DIM)
    v = torch.randn(8, NUM_HEADS, HEAD_DIM)
    cu_seqlens = torch.tensor([0, 4, 8])
    before = varlen_attention(q, q, v, cu_seqlens)
    v[4:] += 100.0  # only the second segment's values change
    after = varlen_attention(q, q, v, cu_seqlens)
    assert torch.equal(before[:4], after[:4])
    assert not torch.allclose(before[4:], after[4:])
