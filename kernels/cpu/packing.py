"""How weights are laid out for the native CPU kernels, in their stored formats (`FORMATS`).

float32 keeps either memory order (see `engine.models.matmul.matmul_layout`); bfloat16,
float16 and int8 are a contiguous `[in, out]` or packed (`pack_matrix`, a 4-D tensor:
`matrix_shape` gives its `[in, out]`, `unpacked` its columns), int8 also as quad panels where
the CPU has integer dot products (`pack_quads`, 4-D too); stacked experts `[E, in, out]`
likewise, packed as `[E, ...]` of packed ones (`pack_matrices`); an LM head as panels
(`to_head_panels`). The C side of each layout is `formats.h`, `panels.h` and `quads.h`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stillcut.kernels.cpu_flags import _proc_cpu_flags

# The stored formats of weights: dtype -> `enum format` in the C files.
FORMATS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int8: 4}
PACK_ROWS, PACK_COLUMNS = 8, 32  # a packed weight's row groups and column tiles, as in C
PANEL_COLUMNS = 32  # an LM head's panels, as in C
QUAD_ROWS, QUAD_MAX_IN = 4, 65536  # an int8 quad panel's rows side by side, its most inputs


def pack_matrix(parts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """A weight `[in, out]` (or its column blocks `[in, out_i]` side by side) packed, in one
    copy: `[in / PACK_ROWS, out / PACK_COLUMNS, PACK_ROWS, PACK_COLUMNS]`, each group of input
    rows as tiles of columns one after another, each tile its rows of contiguous columns
    (`formats.h`: a group of rows is one stream to read)."""
    return _side_by_side(
        parts,
        PACK_ROWS,
        lambda rows, tiles: (rows, tiles, PACK_ROWS, PACK_COLUMNS),
        lambda grouped: grouped.transpose(1, 2),
        tile_dim=1,
    )


def _side_by_side(parts, rows: int, shape, arrange, tile_dim: int) -> torch.Tensor:
    """`parts` `[in, out_i]` side by side in one new tensor of `shape(in / rows, out / 32)`:
    each part grouped `[in / rows, rows, out_i / 32, 32]` and `arrange`d into its tiles along
    `tile_dim` (parts whose columns are not whole tiles are joined first)."""
    parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
    if any(part.shape[1] % PACK_COLUMNS for part in parts):
        parts = [torch.cat(parts, dim=1)]
    num_in, num_out = parts[0].shape[0], sum(part.shape[1] for part in parts)
    packed = parts[0].new_empty(shape(num_in // rows, num_out // PACK_COLUMNS))
    tile = 0
    for part in parts:  # one part's grouping at a time
        tiles = part.shape[1] // PACK_COLUMNS
        grouped = part.reshape(num_in // rows, rows, tiles, PACK_COLUMNS)
        packed.narrow(tile_dim, tile, tiles).copy_(arrange(grouped))
        tile += tiles
    return packed


def pack_matrices(matrices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Matrices `[in, out]` of one shape (experts) stacked `[E, ...]`: packed (`pack_matrix`)
    where they pack, else contiguous; one copy (and one matrix's while packing)."""
    first = matrices[0]
    if not packs(first.dtype, first.device, *first.shape):
        return torch.stack(list(matrices))
    stacked = first.new_empty(
        len(matrices),
        first.shape[0] // PACK_ROWS,
        first.shape[1] // PACK_COLUMNS,
        PACK_ROWS,
        PACK_COLUMNS,
    )
    for index, matrix in enumerate(matrices):
        stacked[index] = pack_matrix(matrix)
    return stacked


def packs(dtype: torch.dtype, device: torch.device, num_in: int, num_out: int) -> bool:
    """Whether a weight `[in, out]` of `dtype` on `device` is stored packed: in a narrow format
    (float32 keeps the layouts of `engine.models.matmul.matmul_layout`), on CPU, in whole row
    groups and column tiles."""
    narrow = dtype in FORMATS and dtype != torch.float32
    whole = num_in % PACK_ROWS == 0 and num_out % PACK_COLUMNS == 0
    return narrow and torch.device(device).type == "cpu" and whole


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` is packed (or quad panels): a matrix as 4 dims, stacked matrices
    (experts) as 5."""
    return weight.dim() >= 4


def is_quads(weight: torch.Tensor) -> bool:
    """Whether `weight` is an int8 matrix as quad panels (`pack_quads`)."""
    return weight.dim() == 4 and weight.shape[-1] == QUAD_ROWS


def matrix_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The shape of a weight as matrices: `[..., in, out]` of a packed one, else its own."""
    if is_quads(weight):
        panels, quads, columns, rows = weight.shape
        return (quads * rows, panels * columns)
    if is_packed(weight):
        *stack, groups, tiles, rows, columns = weight.shape
        return (*stack, groups * rows, tiles * columns)
    return tuple(weight.shape)


def unpacked(weight: torch.Tensor, columns: slice = slice(None)) -> torch.Tensor:
    """Columns `columns` (a packed weight's: whole tiles or panels) of a weight as an
    `[in, out]` tensor: a copy of a packed one, a view of any other."""
    if not is_packed(weight):
        return weight[:, columns]
    num_in, num_out = matrix_shape(weight)
    start, stop, _ = columns.indices(num_out)
    if start % PACK_COLUMNS or (stop % PACK_COLUMNS and stop != num_out):
        raise ValueError(f"columns [{start}, {stop}) of a packed weight are not whole tiles")
    first, end = start // PACK_COLUMNS, -(-stop // PACK_COLUMNS)
    if is_quads(weight):  # [panels, in / 4, 32, 4] -> [in / 4, 4, panels, 32]
        return weight[first:end].permute(1, 3, 0, 2).reshape(num_in, stop - start)
    return weight[:, first:end].transpose(1, 2).reshape(num_in, stop - start)


def integer_dots() -> bool:
    """Whether this CPU has AVX-512 VNNI, whose integer dot products read an int8 weight
    faster than widening it does (`quad_product` in `quads.h`)."""
    return "avx512_vnni" in _proc_cpu_flags()  # what the compiler sees, whatever is forced


def quads_fit(dtype: torch.dtype, device: torch.device | str, num_in: int, num_out: int) -> bool:
    """Whether an `[in, out]` weight of `dtype` on `device` is stored as quad panels: int8 on
    a CPU with integer dot products, in whole quads and panels, its sums within 32 bits."""
    whole = num_in % QUAD_ROWS == 0 and num_out % PANEL_COLUMNS == 0 and num_in <= QUAD_MAX_IN
    return dtype == torch.int8 and torch.device(device).type == "cpu" and whole and integer_dots()


def pack_quads(parts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """An int8 weight `[in, out]` (or its column blocks side by side) as quad panels, in one
    copy: `[out / 32, in / 4, 32, 4]`, each panel its 32 columns' input rows four at a time,
    the four rows of each column side by side (what one integer dot product takes)."""
    return _side_by_side(
        parts,
        QUAD_ROWS,
        lambda quads, panels: (panels, quads, PANEL_COLUMNS, QUAD_ROWS),
        lambda grouped: grouped.permute(2, 0, 3, 1),
        tile_dim=0,
    )


def panels_shape(head: torch.Tensor) -> tuple[int, int]:
    """The `[in, out]` (hidden, vocab) of a head stored as panels `[vocab / PANEL_COLUMNS,
    hidden, PANEL_COLUMNS]` (`engine.models.matmul.head_layout`): each panel its 32 columns'
    input rows one after another, read as one stream by the kernel's `panel_product`."""
    panels, hidden, columns = head.shape
    return hidden, panels * columns


def head_panels_shape(
    dtype: torch.dtype, device: torch.device | str, vocab: int, hidden: int
) -> tuple[int, ...] | None:
    """The shape an LM head table `[vocab, hidden]` of `dtype` on `device` is stored in as
    panels (on CPU, whole panels): int8 quad panels where `quads_fit`, else `[vocab / 32,
    hidden, 32]`; None where it is not stored as panels."""
    if torch.device(device).type != "cpu" or vocab % PANEL_COLUMNS:
        return None
    if quads_fit(dtype, device, hidden, vocab):
        return (vocab // PANEL_COLUMNS, hidden // QUAD_ROWS, PANEL_COLUMNS, QUAD_ROWS)
    return (vocab // PANEL_COLUMNS, hidden, PANEL_COLUMNS)


def to_head_panels(table: torch.Tensor) -> torch.Tensor:
    """A table `[vocab, hidden]` (rows `[start, stop)` of one, whole panels) as the panels of
    `head_panels_shape` (a copy)."""
    vocab, hidden = table.shape
    if quads_fit(table.dtype, table.device, hidden, vocab):
        return pack_quads(table.T)
    return table.reshape(vocab // PANEL_COLUMNS, PANEL_COLUMNS, hidden).transpose(1, 2).contiguous()


def panel_rows(head: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the table `[vocab, hidden]` whose head is stored as panels (or as int8
    quad panels): `[N, hidden]`."""
    if is_quads(head):
        return head[ids // PANEL_COLUMNS, :, ids % PANEL_COLUMNS, :].reshape(ids.numel(), -1)
    return head[ids // PANEL_COLUMNS, :, ids % PANEL_COLUMNS]
