"""The decode fast paths against plain torch: banded matvecs and the blocked greedy argmax."""

from __future__ import annotations

import pytest
import torch

from stillcut.engine.models.layers import bands, head_layout, linear, matmul_layout, vocab_logits
from stillcut.engine.sampler import first_argmax


@pytest.mark.parametrize(("num_in", "num_out"), [(64, 96), (96, 64), (48, 64), (7, 5), (5, 7)])
@pytest.mark.parametrize("num_rows", [1, 3, 16, 17])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_linear_equals_a_matmul_in_every_layout(num_in, num_out, num_rows, threads):
    torch.manual_seed(num_in * num_out + num_rows)
    weight = torch.randn(num_in, num_out)
    layouts = (matmul_layout(weight), weight.contiguous(), weight.T.contiguous().T)
    # the rows of x may be strided, as a chunk of a wider activation is
    inputs = (torch.randn(num_rows, num_in), torch.randn(num_rows, 2 * num_in)[:, :num_in])
    adds = (None, torch.randn(num_out), torch.randn(num_rows, num_out))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for layout in layouts:
            for x in inputs:
                for add in adds:
                    expected = x @ weight if add is None else torch.addmm(add, x, weight)
                    torch.testing.assert_close(linear(x, layout, add), expected)
    finally:
        torch.set_num_threads(before)


def test_vocab_logits_equal_the_head_product():
    torch.manual_seed(0)
    table = torch.randn(1000, 32)  # [vocab, hidden], as a checkpoint stores it
    head = head_layout(table)
    assert head.shape == (32, 1000) and head.is_contiguous()
    for banded in (None, (bands(head), bands(head, 64))):
        for num_rows in (1, 4, 40):
            hidden = torch.randn(num_rows, 32)
            logits = vocab_logits(hidden, head, banded)
            torch.testing.assert_close(logits, hidden @ table.T)


@pytest.mark.parametrize("vocab", [151936, 4096, 1000, 7])
@pytest.mark.parametrize("num_rows", [1, 5])
def test_first_argmax_equals_argmax_with_ties(vocab, num_rows):
    torch.manual_seed(vocab + num_rows)
    for values in (
        torch.randn(num_rows, vocab),
        torch.randint(0, 3, (num_rows, vocab)).float(),  # ties everywhere: lowest index wins
        torch.full((num_rows, vocab), -1.0).index_fill_(1, torch.tensor([vocab - 1, 0]), 2.0),
        torch.randn(num_rows, vocab).index_fill_(1, torch.tensor([vocab // 2]), float("nan")),
        torch.randn(num_rows, 2 * vocab)[:, ::2],  # strided rows
        torch.randn(num_rows, vocab).to(torch.bfloat16),
    ):
        assert torch.equal(first_argmax(values), values.argmax(dim=-1))
