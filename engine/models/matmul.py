"""How a language model's weights are laid out and multiplied: `linear` and the head.

Batch-1 decode is bound by reading the weights, so linear weights are applied as `x @ w` with
`w` `[in, out]` by `linear`, which gives each CPU thread its own band of the weight when only a
few rows go through it, and stored in the memory order that reads fastest. Weights stay in
their stored format (`engine.quantization`): on CPU a bfloat16, float16 or int8 weight
(`<name>_scale` beside an int8 `<name>`) meets float32 activations in the native kernel's
product for a few rows, and is widened a slice of columns at a time for longer batches.
Longer batches (prefill) compute in the model's arithmetic (`engine.arithmetic`): in bfloat16,
their rows are rounded to bfloat16 and meet a bfloat16 weight as stored in bf16 x bf16
products with float32 sums; in W8A8 (`w8a8`), rows quantized per token meet the int8 weight in
exact integer sums. Where the CPU has the dot products for it, the native product
(`kernels.cpu.gemm`: AMX tiles or AVX-512) reads the weight in the layout decode stores it in;
elsewhere torch's GEMMs (oneDNN, `_int_mm`) multiply it unpacked a slice at a time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from stillcut.engine.models.w8a8 import quantized_rows, scaled_sums
from stillcut.engine.quantization import dense
from stillcut.kernels.cpu.decoder import NativeMatrix, native_matrix
from stillcut.kernels.cpu.gemm import bf16_product, w8a8_product
from stillcut.kernels.cpu.packing import (
    PACK_COLUMNS,
    PANEL_COLUMNS,
    head_panels_shape,
    is_quads,
    matrix_shape,
    pack_matrix,
    pack_quads,
    packs,
    panels_shape,
    quads_fit,
    to_head_panels,
    unpacked,
)


def matmul_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [in, out] stored for `linear`: in a narrow format on CPU, packed in groups of
    rows and tiles of columns where its shape allows (`kernels.cpu.packing.pack_matrix`: the
    native kernel reads a group of rows as one stream; int8 on a CPU with integer dot products
    as quad panels, `pack_quads`), else a contiguous `[in, out]`; in
    float32 a contiguous `[in, out]` when out >= in (qkv, gate/up), else the `[in, out]` view
    of a contiguous `[out, in]` (a float32 down projection). Measured on the 2-core CPU, these
    are the orders `linear`'s products read fastest; on GPU both are plain GEMM layouts.
    """
    pack = packing(weight.dtype, weight.device, *weight.shape)
    if pack is not None:
        return pack(weight)
    if weight.shape[1] >= weight.shape[0] or weight.dtype != torch.float32:
        return weight.contiguous()
    return weight.T.contiguous().T


def packing(dtype: torch.dtype, device: torch.device, num_in: int, num_out: int):
    """How `matmul_layout` packs an `[in, out]` weight of `dtype` on `device` (a function of
    the weight or its column blocks side by side, `pack_quads` or `pack_matrix`), or None."""
    if quads_fit(dtype, device, num_in, num_out):
        return pack_quads
    return pack_matrix if packs(dtype, device, num_in, num_out) else None


def head_layout(weight: torch.Tensor) -> torch.Tensor:
    """An LM head `[vocab, hidden]` (or a tied embedding) stored for `vocab_logits`: on CPU,
    where the vocabulary is whole panels, as panels `[vocab / 32, hidden, 32]`
    (`kernels.cpu.packing.panels_shape`: the native product reads each thread's panels as one
    stream, its sums in registers; an int8 one as quad panels `[vocab / 32, hidden / 4, 32, 4]`
    where `quads_fit`), else a contiguous `[hidden, vocab]`, read in column bands
    by one matvec per thread. The loader makes either as it reads the table (`Conversion.head`),
    so here it is only kept; a table in any other layout is copied. The head is the embedding
    table of a tied model (`head_table`: a strided gather, a few rows per step)."""
    if weight.dim() == 3 or is_quads(weight):
        return weight
    if head_panels_shape(weight.dtype, weight.device, *weight.shape) is not None:
        return to_head_panels(weight)
    return weight.T.contiguous()


def head_matrix(head: torch.Tensor) -> torch.Tensor:
    """A `head_layout` head as the `[hidden, vocab]` matrix it multiplies by (a copy of
    panels)."""
    return _columns(head, slice(0, head_shape(head)[1]))


def head_shape(head: torch.Tensor) -> tuple[int, int]:
    """`[hidden, vocab]` of a `head_layout` head."""
    return panels_shape(head) if head.dim() == 3 else matrix_shape(head)


def head_table(head: torch.Tensor) -> torch.Tensor:
    """The embedding table `[vocab, hidden]` a tied `head_layout` head is: its transpose, or the
    panels themselves (`embedding_rows` and the native step read those as such)."""
    return head if head.dim() != 2 else head.T


def vocab_logits(
    hidden: torch.Tensor, heads: tuple[StoredMatrix, StoredMatrix] | StoredMatrix
) -> torch.Tensor:
    """fp32 logits `[S, vocab]` of `hidden` `[S, hidden]` through a `head_layout` head, as
    prepared for one row and for several (`prepare_matrices`), or one `StoredMatrix`."""
    if not isinstance(heads, StoredMatrix):  # (one row's, several rows')
        heads = heads[hidden.shape[0] > 1]
    return linear(hidden, heads).float()


HEAD_BANDS_FOR_ROWS = 64  # measured: 8 rows through a 150k head 1.4x faster than with 4 bands


class Bands(NamedTuple):
    """A weight cut into k bands for `linear`'s matvec (by default one per thread):
    `[k, in, out/k]` column bands of a contiguous `[in, out]`, or `[k, out/k, in]` row bands of
    a contiguous `[out, in]` (views, no copy)."""

    by_columns: bool
    view: torch.Tensor


def bands(weight: torch.Tensor, count: int | None = None) -> Bands:
    """`weight` (`matmul_layout` / `head_layout`) as `Bands`: `count` of them (rounded down to
    a divisor of out), by default one per thread."""
    num_in, num_out = weight.shape
    if weight.is_contiguous():
        k = _band_count(num_out, count or torch.get_num_threads())
        return Bands(True, weight.view(num_in, k, num_out // k).transpose(0, 1))
    k = _band_count(num_out, count or 2 * torch.get_num_threads())
    return Bands(False, weight.T.reshape(k, num_out // k, num_in))  # weight.T is contiguous


PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


WIDEN_BYTES = 32 << 20  # a longer batch's product widens this many float32 bytes of w at once


class StoredMatrix(NamedTuple):
    """A weight `[in, out]` as `linear` multiplies by it: the tensor in its stored format, an
    int8 weight's per-column `scale` `[out]`, and what is made from it once: `bands` (float32:
    the banded views of a few-row product) or `native` (other formats on CPU: the kernel's
    product; None without a kernel). `arithmetic`: the dtype a long batch's product computes
    in on CPU (None: its input's)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    bands: Bands | None = None
    native: NativeMatrix | None = None
    arithmetic: torch.dtype | None = None


def stored_matrix(
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    band_count: int | None = None,
    arithmetic: torch.dtype | None = None,
) -> StoredMatrix:
    """`weight` (with its int8 `scale`) prepared for `linear`: the native product on CPU and,
    for a float32 `[in, out]` weight (not packed, not panels), `band_count` bands of it (see
    `bands`) too; long batches computing in `arithmetic`."""
    native = native_matrix(weight, scale) if weight.is_cpu else None
    if arithmetic == torch.int8 and scale is None:  # W8A8 of an unquantized matrix (a kept head)
        arithmetic = None
    if weight.dtype == torch.float32 and scale is None and weight.dim() == 2:
        return StoredMatrix(
            weight, bands=bands(weight, band_count), native=native, arithmetic=arithmetic
        )
    return StoredMatrix(weight, scale, native=native, arithmetic=arithmetic)


def expert_matrices(
    module: nn.Module, names: tuple[str, ...], arithmetic: torch.dtype | None = None
) -> list[tuple[StoredMatrix, ...]]:
    """Per expert, its matrices from the stacks `module.<name>` (experts' `[E, in, out]`,
    packed ones too; int8 with `<name>_scale` `[E, out]`), prepared for `linear`
    (`stored_matrix`), long batches computing in `arithmetic`."""
    stacks = [(getattr(module, name), scale_of(module, name)) for name in names]
    return [
        tuple(
            stored_matrix(weights[e], None if scales is None else scales[e], arithmetic=arithmetic)
            for weights, scales in stacks
        )
        for e in range(stacks[0][0].shape[0])
    ]


def scale_of(module: nn.Module, name: str) -> torch.Tensor | None:
    """The per-column scales of `module.<name>` when it is int8 (`<name>_scale`), else None."""
    return getattr(module, f"{name}_scale", None)


class ProjectingModule(nn.Module):
    """A module whose `projections` are `[in, out]` weights for `linear`; `matrices` holds
    them prepared (`prepare_projections`), and `matrix` gives one either way."""

    projections: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.matrices: dict[str, StoredMatrix] = {}

    def prepare_projections(self, arithmetic: torch.dtype | None = None) -> None:
        """Prepare every projection for `linear`, long batches computing in `arithmetic`
        (kept beside the weights: on a weight itself, a view would keep it alive)."""
        self.matrices = {
            name: stored_matrix(getattr(self, name), scale_of(self, name), arithmetic=arithmetic)
            for name in self.projections
        }

    def matrix(self, name: str) -> StoredMatrix:
        prepared = self.matrices.get(name)
        return prepared or StoredMatrix(getattr(self, name), scale_of(self, name))


def prepare_matrices(model: nn.Module) -> None:
    """Prepare each decoder layer's projections and the model's `head_matrices` (for one row,
    and for several: a gemm over many narrow bands packs less of the head at once; a head in
    panels has no bands, and one prepared matrix serves both), long batches computing in the
    `matrix_dtype` of the model's `weight_format` (None without one: their input's)."""
    weight_format = model.weight_format
    arithmetic = None if weight_format is None else weight_format.matrix_dtype
    for layer in model.layers:
        layer.prepare_projections(arithmetic)
    head, scale = model.lm_head, scale_of(model, "lm_head")
    one_row = stored_matrix(head, scale, arithmetic=arithmetic)
    several = (
        one_row if head.dim() != 2 else stored_matrix(head, scale, HEAD_BANDS_FOR_ROWS, arithmetic)
    )
    model.head_matrices = (one_row, several)


def linear(
    x: torch.Tensor,
    matrix: StoredMatrix | torch.Tensor,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x` `[N, in]` @ a weight `[in, out]` (a `matmul_layout` or `head_layout` tensor, or it
    prepared by `stored_matrix`), plus `add` (a bias `[out]` or a residual `[N, out]`) ->
    `[N, out]` in `x`'s dtype.

    A few rows on CPU (decode) are bound by reading the weight. Measured on the 2-core CPU,
    MKL's gemm reads a weight 1.3-1.8x slower than memory allows there, while a `bmm` that
    gives each thread its own band of the weight runs near the read floor for one row; for 2
    to 16 rows (a verify step of speculative decoding, a short chunk) the native product,
    which streams the weight once for all rows, is faster still (5 rows through a 150k head:
    27 ms against the bands' 50). Longer batches are plain gemms. A weight stored narrower
    than `x` (on CPU) is read by the native product for up to `NATIVE_MAX_ROWS` rows, and
    widened a slice of columns at a time for more. More rows than that compute in the
    matrix's `arithmetic` (see the module docstring).
    """
    if isinstance(matrix, torch.Tensor):
        matrix = StoredMatrix(matrix)
    weight = matrix.weight
    long_batch = x.is_cpu and x.shape[0] > NATIVE_MAX_ROWS
    if long_batch and matrix.arithmetic not in (None, x.dtype):
        return _long_product(x, matrix, add)
    if weight.dim() != 2 or (x.is_cpu and (weight.dtype != x.dtype or matrix.scale is not None)):
        if x.is_cpu and matrix.native is not None and not long_batch:
            return matrix.native(x, add)
        return _widened_product(x, matrix, add)
    if (
        matrix.native is not None
        and 1 < x.shape[0] <= BANDED_MAX_ROWS
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()  # the native product has no backward
    ):
        return matrix.native(x, add)
    if not x.is_cpu or x.shape[0] > BANDED_MAX_ROWS:
        return x @ weight if add is None else torch.addmm(add, x, weight)
    by_columns, view = bands(weight) if matrix.bands is None else matrix.bands
    num_rows, num_out, k = x.shape[0], weight.shape[1], view.shape[0]
    if by_columns:  # [k, N, in] @ [k, in, out/k] -> [k, N, out/k]
        left, right, shape = x.expand(k, -1, -1), view, (k, num_rows, num_out // k)
    else:  # [k, out/k, in] @ [k, in, N] -> [k, out/k, N]
        left, right, shape = view, x.T.expand(k, -1, -1), (k, num_out // k, num_rows)
    if num_rows == 1:  # the bands lie in order in memory: the result is a view
        if add is None:
            return torch.bmm(left, right).view(1, num_out)
        return torch.baddbmm(add.reshape(shape), left, right).view(1, num_out)
    result = torch.bmm(left, right)
    if by_columns:
        result = result.transpose(0, 1).reshape(num_rows, num_out)
    else:
        result = result.reshape(num_out, num_rows).T
    return result if add is None else result + add


BANDED_MAX_ROWS = 16


# Measured on the 2-core CPU (bfloat16, 768-1536 inputs): the native product beat widening the
# weight for 17 to 48 rows by 1.3-2x (a short prompt chunk, such as the question after a
# prefix-cache hit), and was no faster at 64.
NATIVE_MAX_ROWS = 32


def _long_product(x: torch.Tensor, matrix: StoredMatrix, add: torch.Tensor | None) -> torch.Tensor:
    """`linear` of a long batch computing in the matrix's arithmetic: the native product
    reading the stored layout where this CPU has its dot products, else `_widened_product`."""
    result = None
    if matrix.arithmetic == torch.bfloat16:
        result = bf16_product(x, matrix.weight, add)
    elif matrix.arithmetic == torch.int8:  # W8A8 (`stored_matrix` keeps it only with a scale)
        result = w8a8_product(x, matrix.weight, matrix.scale, add)
    return _widened_product(x, matrix, add) if result is None else result


def _widened_product(
    x: torch.Tensor, matrix: StoredMatrix, add: torch.Tensor | None
) -> torch.Tensor:
    """`linear` of a narrow (or packed) weight, or of a long batch computing in another
    dtype than `x`'s: `x` rounded to the matrix's arithmetic (by default `x`'s dtype; int8:
    quantized per row, see `w8a8`) and the weight widened or rounded to it `WIDEN_BYTES` at a
    time (a packed one's in whole tiles; a weight stored in the arithmetic is only read), so no
    full-precision copy of a large weight (an LM head) ever exists. The result, and `add`, in
    `x`'s dtype."""
    weight, scale = matrix.weight, matrix.scale
    dtype = matrix.arithmetic if x.is_cpu and x.shape[0] > NATIVE_MAX_ROWS else None
    num_in, num_out = head_shape(weight)  # (any layout's)
    width = max(1, WIDEN_BYTES // (4 * num_in))
    if weight.dim() != 2:  # whole tiles or panels
        width = max(PACK_COLUMNS, width // PACK_COLUMNS * PACK_COLUMNS)
    if dtype in (None, x.dtype) and width >= num_out:
        widened = dense(_columns(weight, slice(0, num_out)), scale, 1, x.dtype)
        return x @ widened if add is None else torch.addmm(add, x, widened)
    product = _column_product(x, weight, scale, dtype)
    if width >= num_out:
        result = product(slice(0, num_out)).to(x.dtype)
        return result if add is None else result.add_(add)
    out = torch.empty(x.shape[0], num_out, dtype=x.dtype, device=x.device)
    for start in range(0, num_out, width):
        columns = slice(start, min(start + width, num_out))
        out[:, columns] = product(columns)
    return out if add is None else out.add_(add)


def _column_product(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype | None
):
    """A function of a slice of columns: `x` times those columns of `weight` computed in
    `dtype` (None: `x`'s; int8 with an int8 weight: W8A8)."""
    if dtype == torch.int8 and scale is not None:
        rows = quantized_rows(x)
        return lambda columns: scaled_sums(rows, _columns(weight, columns), scale[columns])
    rows = x if dtype in (None, x.dtype) else x.to(dtype)

    def product(columns: slice) -> torch.Tensor:
        part = None if scale is None else scale[columns]
        return rows @ dense(_columns(weight, columns), part, 1, rows.dtype)

    return product


def _columns(weight: torch.Tensor, columns: slice) -> torch.Tensor:
    """Columns `columns` of a weight (`matmul_layout`, packed, or a head's panels: whole
    ones) as an `[in, out]` tensor: a view, or a copy of packed ones."""
    if weight.dim() != 3:
        return unpacked(weight, columns)
    panels = weight[columns.start // PANEL_COLUMNS : -(-columns.stop // PANEL_COLUMNS)]
    return panels.transpose(0, 1).reshape(weight.shape[1], -1)


def _band_count(num_out: int, wanted: int) -> int:
    """The largest band count <= `wanted` that divides `num_out`."""
    return next(k for k in range(max(wanted, 1), 0, -1) if num_out % k == 0)
