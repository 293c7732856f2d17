"""The decode fast paths against plain torch: banded matvecs, products with weights in their
stored formats, and the blocked greedy argmax."""

from __future__ import annotations

import contextlib

import pytest
import torch

from stillcut.engine.models import matmul
from stillcut.engine.models.matmul import (
    StoredMatrix,
    head_layout,
    head_matrix,
    head_shape,
    head_table,
    linear,
    matmul_layout,
    stored_matrix,
    vocab_logits,
)
from stillcut.engine.models.weights import embedding_rows
from stillcut.engine.quantization import dense, quantize_int8
from stillcut.engine.sampler import first_argmax, first_argmax_ids
from stillcut.kernels.cpu import library
from stillcut.kernels.cpu.packing import (
    integer_dots,
    is_packed,
    is_quads,
    matrix_shape,
    pack_matrix,
    pack_quads,
    unpacked,
)


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
    for heads in (stored_matrix(head), (stored_matrix(head), stored_matrix(head, None, 64))):
        for num_rows in (1, 4, 40):
            hidden = torch.randn(num_rows, 32)
            logits = vocab_logits(hidden, heads)
            torch.testing.assert_close(logits, hidden @ table.T)


def _stored(weight: torch.Tensor, dtype: torch.dtype):
    """`weight` `[in, out]` in `dtype` (int8: quantized per output column) and its scale."""
    if dtype == torch.int8:
        return quantize_int8(weight, 1)
    return weight.to(dtype), None


@contextlib.contextmanager
def _native_products(threads: int, seed: int):
    """Torch (and the native product) on `threads` threads, seeded; skipped without a C
    compiler."""
    if library.load() is None:
        pytest.skip("no C compiler: the native product is not built")
    torch.manual_seed(seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _assert_products(matrix, widened: torch.Tensor, row_counts: tuple[int, ...]) -> None:
    """`linear` through `matrix` equals x @ `widened` (+ a bias, + a residual) for x of each
    row count, its rows strided (float32 rounding: sums over more inputs, in another order,
    drift further)."""
    num_in, num_out = widened.shape
    tolerance = {"atol": 1e-5 * max(1.0, num_in / 32), "rtol": 1e-5}
    for num_rows in row_counts:
        x = torch.randn(num_rows, 2 * num_in)[:, :num_in]
        for add in (None, torch.randn(num_out), torch.randn(num_rows, num_out)):
            expected = x @ widened if add is None else torch.addmm(add, x, widened)
            torch.testing.assert_close(linear(x, matrix, add), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("threads", [1, 3])
def test_linear_of_a_stored_weight_equals_the_product_with_it_widened(dtype, threads):
    """The native product (few rows: every size of its groups of up to 8 rows, widths that
    leave vector tails and input rows past the last 8; one row of a narrow weight, read an
    input row at a time, and of a wider one; input rows dealt out to the threads in many
    chunks) and the sliced widening (more rows) compute x @ the widened weight; the stored
    weight is never widened whole in place."""
    with _native_products(threads, seed=7):
        for num_in, num_out in ((37, 45), (37, 1100), (264, 1100)):  # the last: many chunks
            weight, scale = _stored(torch.randn(num_in, num_out), dtype)
            widened = dense(weight, scale, 1, torch.float32)
            matrix = stored_matrix(weight, scale)
            assert matrix.native is not None and matrix.weight is weight
            _assert_products(matrix, widened, (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40))
            assert weight.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_linear_of_a_packed_weight_equals_the_product_with_it_widened(dtype, threads):
    """A narrow weight on CPU whose shape allows is stored packed (groups of 8 input rows as
    tiles of 32 columns); the native product (one row and groups of rows, bands of whole row
    groups, narrow and wide outputs, a vocabulary-wide one split by columns) and the sliced
    widening of more rows read it as the [in, out] weight it packs; columns unpack by tiles."""
    with _native_products(threads, seed=3):
        for num_in, num_out in ((40, 96), (24, 1120), (256, 1088), (16, 32768 + 64)):
            weight, scale = _stored(torch.randn(num_in, num_out), dtype)
            packed = pack_matrix(weight)
            if dtype != torch.int8 or not integer_dots():  # (else int8 is stored as quads)
                assert torch.equal(matmul_layout(weight), packed)
            assert is_packed(packed) and matrix_shape(packed) == (num_in, num_out)
            assert torch.equal(unpacked(packed), weight)
            assert torch.equal(unpacked(packed, slice(64, 96)), weight[:, 64:96])
            assert torch.equal(pack_matrix([weight[:, :32], weight[:, 32:]]), packed)
            widened = dense(weight, scale, 1, torch.float32)
            _assert_products(stored_matrix(packed, scale), widened, (1, 2, 5, 8, 9, 17, 40))
            x = torch.randn(40, num_in)  # no native product: widened by whole tiles
            torch.testing.assert_close(linear(x, StoredMatrix(packed, scale)), x @ widened)
        assert not is_packed(matmul_layout(torch.randn(40, 100).to(dtype)))  # no whole tiles
        assert not is_packed(matmul_layout(torch.randn(40, 96)))  # float32 keeps its layouts


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_linear_of_int8_quad_panels_equals_the_product_with_it_widened(threads):
    """An int8 weight on a CPU with integer dot products is stored as quad panels (`[out / 32,
    in / 4, 32, 4]`); the native product (integer sums of x in fixed point, groups of up to 3
    rows, whole panels per thread; widened where x is not finite or the CPU lacks them) and
    the sliced widening of more rows read it as the [in, out] weight; columns unpack by
    panels. Its error is no larger than float32 sums': x is exact within 2^7 of its largest."""
    with _native_products(threads, seed=13):
        for num_in, num_out in ((4, 32), (36, 96), (260, 1120), (2048, 64)):
            weight, scale = _stored(torch.randn(num_in, num_out), torch.int8)
            quads = pack_quads(weight)
            assert quads.shape == (num_out // 32, num_in // 4, 32, 4)
            assert is_quads(quads) and matrix_shape(quads) == (num_in, num_out)
            assert torch.equal(unpacked(quads), weight)
            assert torch.equal(unpacked(quads, slice(32, 64)), weight[:, 32:64])
            assert torch.equal(pack_quads([weight[:, :32], weight[:, 32:]]), quads)
            if integer_dots():
                assert torch.equal(matmul_layout(weight), quads)
            widened = dense(weight, scale, 1, torch.float32)
            _assert_products(stored_matrix(quads, scale), widened, (1, 2, 3, 4, 5, 8, 17, 32))
            x = torch.randn(40, num_in)  # no native product: widened by whole panels
            torch.testing.assert_close(linear(x, StoredMatrix(quads, scale)), x @ widened)
        matrix = stored_matrix(quads, scale)
        x = torch.randn(3, num_in, dtype=torch.float64)
        x[1] *= 1e-30  # tiny values keep their precision (the fixed point is per row)
        x[2, ::3] *= 1e-3  # values far below the row's largest
        exact = x @ dense(weight, scale, 1, torch.float64)
        error = (linear(x.float(), matrix).double() - exact).abs()
        float_error = (x.float() @ widened - exact).abs()
        assert (error <= 4 * float_error.amax(dim=1, keepdim=True) + 1e-45).all()
        x = torch.randn(2, num_in)
        x[0, 5] = float("inf")  # not finite: widened, as float32 sums give it
        got, expected = linear(x, matrix), x @ widened
        assert torch.equal(got[0].isinf(), expected[0].isinf())
        assert torch.equal(got[0].isnan(), expected[0].isnan())
        torch.testing.assert_close(got[1], expected[1], atol=1e-5 * num_in / 32, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_head_in_panels_equals_the_product_with_it_widened(dtype, threads, monkeypatch):
    """On CPU a head whose vocabulary is whole 32-column panels is stored as panels `[vocab /
    32, hidden, 32]` (int8 on a CPU with integer dot products: quad panels, where hidden % 4 ==
    0): the native product (rows in groups of up to 8, one row in two chains, an odd hidden
    size, a vocabulary wider than the column split's threshold), the widening of more rows
    (whole panels at a time) and the gather of a tied table's rows read it as the `[hidden,
    vocab]` head."""
    with _native_products(threads, seed=5):
        for hidden, vocab in ((33, 96), (64, 32768 + 64)):
            weight, scale = _stored(torch.randn(hidden, vocab), dtype)  # scales per vocab id
            head = head_layout(weight.T)  # from the [vocab, hidden] table, as a checkpoint's
            quads = dtype == torch.int8 and integer_dots() and hidden % 4 == 0  # int8: quads
            layout = (vocab // 32, hidden // 4, 32, 4) if quads else (vocab // 32, hidden, 32)
            assert head.shape == layout and head_shape(head) == (hidden, vocab)
            assert torch.equal(head_matrix(head), weight)
            widened = dense(weight, scale, 1, torch.float32)
            _assert_products(stored_matrix(head, scale), widened, (1, 2, 5, 8, 9, 17, 40))
            ids = torch.tensor([0, 31, 32, vocab - 1])
            rows = embedding_rows(ids, head_table(head), scale, torch.float32)
            torch.testing.assert_close(rows, widened.T[ids])
        monkeypatch.setattr(matmul, "WIDEN_BYTES", 4 * hidden * 40)  # 40 columns: 2 panels
        x = torch.randn(40, hidden)
        torch.testing.assert_close(linear(x, StoredMatrix(head, scale)), x @ widened)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_vocabulary_wide_product_equals_the_product_with_it_widened(dtype):
    """A weight as wide as a vocabulary is shared between threads by columns, not by input
    rows (ranges of 32 columns, the last one short)."""
    if library.load() is None:
        pytest.skip("no C compiler: the native product is not built")
    torch.manual_seed(11)
    num_out = 32768 + 45
    weight, scale = _stored(torch.randn(13, num_out), dtype)
    widened = dense(weight, scale, 1, torch.float32)
    matrix = stored_matrix(weight, scale)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for num_rows in (1, 5, 16):
                x = torch.randn(num_rows, 13)
                for add in (None, torch.randn(num_out), torch.randn(num_rows, num_out)):
                    expected = x @ widened if add is None else torch.addmm(add, x, widened)
                    torch.testing.assert_close(matrix.native(x, add), expected)
    finally:
        torch.set_num_threads(before)


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
        assert first_argmax_ids(values) == values.argmax(dim=-1).tolist()
