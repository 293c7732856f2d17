"""Pieces every language model here shares: weight layout, frozen parameters, rotary embedding.

Batch-1 decode is bound by reading the weights, so linear weights are applied as `x @ w` with
`w` `[in, out]` by `linear`, which gives each CPU thread its own band of the weight when only a
few rows go through it, and stored in the memory order that reads fastest. Weights stay in
their stored format (`engine.quantization`): on CPU a bfloat16, float16 or int8 weight
(`<name>_scale` beside an int8 `<name>`) meets float32 activations in the native kernel's
product for a few rows, and is widened a slice of columns at a time for longer batches. Rotary
tables come as cos and a signed sin, `[N, 1, D]`, so that rotating q and k heads is one fused op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.anon_memory import release_freed_memory
from stillcut.engine.loader import load_weights
from stillcut.engine.models.weight_snapshot import WeightSnapshot
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.positions import LinearCursor
from stillcut.engine.quantization import WeightFormat, dense, plan_formats
from stillcut.kernels.attention import AttentionMetadata, paged_attention, write_kv
from stillcut.kernels.cpu_decode import CpuDecoder, NativeMatrix, bind, native_matrix
from stillcut.kernels.cpu_decode_stack import (
    PACK_COLUMNS,
    PANEL_COLUMNS,
    Stack,
    head_panels_shape,
    is_quads,
    matrix_shape,
    pack_matrix,
    pack_quads,
    packs,
    panel_rows,
    panels_shape,
    quads_fit,
    to_head_panels,
    unpacked,
)

log = logging.getLogger(__name__)

LM_HEAD_PREFIX = "lm_head."


def matmul_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [in, out] stored for `linear`: in a narrow format on CPU, packed in groups of
    rows and tiles of columns where its shape allows (`cpu_decode_stack.pack_matrix`: the
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
    (`cpu_decode_stack.panels_shape`: the native product reads each thread's panels as one
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
    product; None without a kernel)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    bands: Bands | None = None
    native: NativeMatrix | None = None


def stored_matrix(
    weight: torch.Tensor, scale: torch.Tensor | None = None, band_count: int | None = None
) -> StoredMatrix:
    """`weight` (with its int8 `scale`) prepared for `linear`: the native product on CPU and,
    for a float32 `[in, out]` weight (not packed, not panels), `band_count` bands of it (see
    `bands`) too."""
    native = native_matrix(weight, scale) if weight.is_cpu else None
    if weight.dtype == torch.float32 and scale is None and weight.dim() == 2:
        return StoredMatrix(weight, bands=bands(weight, band_count), native=native)
    return StoredMatrix(weight, scale, native=native)


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

    def prepare_projections(self) -> None:
        """Prepare every projection for `linear` (kept beside the weights: on a weight itself,
        a view would keep it alive)."""
        self.matrices = {
            name: stored_matrix(getattr(self, name), scale_of(self, name))
            for name in self.projections
        }

    def matrix(self, name: str) -> StoredMatrix:
        prepared = self.matrices.get(name)
        return prepared or StoredMatrix(getattr(self, name), scale_of(self, name))


def prepare_matrices(model: nn.Module) -> None:
    """Prepare each decoder layer's projections and the model's `head_matrices` (for one row,
    and for several: a gemm over many narrow bands packs less of the head at once; a head in
    panels has no bands, and one prepared matrix serves both)."""
    for layer in model.layers:
        layer.prepare_projections()
    head, scale = model.lm_head, scale_of(model, "lm_head")
    one_row = stored_matrix(head, scale)
    several = one_row if head.dim() != 2 else stored_matrix(head, scale, HEAD_BANDS_FOR_ROWS)
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
    widened a slice of columns at a time for more.
    """
    if isinstance(matrix, torch.Tensor):
        matrix = StoredMatrix(matrix)
    weight = matrix.weight
    if weight.dim() != 2 or (x.is_cpu and (weight.dtype != x.dtype or matrix.scale is not None)):
        if x.is_cpu and matrix.native is not None and x.shape[0] <= NATIVE_MAX_ROWS:
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


def _widened_product(
    x: torch.Tensor, matrix: StoredMatrix, add: torch.Tensor | None
) -> torch.Tensor:
    """`linear` of a narrow (or packed) weight: widened to `x`'s dtype `WIDEN_BYTES` at a time
    (a packed one's in whole tiles), so no full-precision copy of a large weight (an LM head)
    ever exists."""
    weight, scale = matrix.weight, matrix.scale
    num_in, num_out = head_shape(weight)  # (any layout's)
    width = max(1, WIDEN_BYTES // (4 * num_in))
    if weight.dim() != 2:  # whole tiles or panels
        width = max(PACK_COLUMNS, width // PACK_COLUMNS * PACK_COLUMNS)
    if width >= num_out:
        widened = dense(_columns(weight, slice(0, num_out)), scale, 1, x.dtype)
        return x @ widened if add is None else torch.addmm(add, x, widened)
    out = torch.empty(x.shape[0], num_out, dtype=x.dtype, device=x.device)
    for start in range(0, num_out, width):
        columns = slice(start, min(start + width, num_out))
        part = None if scale is None else scale[columns]
        out[:, columns] = x @ dense(_columns(weight, columns), part, 1, x.dtype)
    return out if add is None else out.add_(add)


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


class PagedLanguageModel(nn.Module):
    """What the runner asks of every language model beside `forward`, `compute_logits` and
    `prompt_positions`: `extend_positions` (positions as a fold over appended input), its layer
    count and the shape of one layer's paged KV cache. `config` has `num_layers`,
    `num_kv_heads` and `head_dim`. `prepare_weights` (called by the model's
    `from_checkpoint`) makes what is derived from the weights: `head_matrices` and the layers'
    prepared projections (`prepare_matrices`), and `cpu_decoder`, the native CPU decode step,
    from `native_stack` where the kernel serves it. `weight_format` is how its weights are
    stored (`engine.quantization.WeightFormat`).

    `forward(input_ids [N], positions, kv_caches, metadata, mm_embeds=None, mm_mask=None)`
    returns final hidden states [N, hidden]; `mm_embeds` [M, hidden] replace the embeddings of
    the M rows where `mm_mask` [N] is True. A model whose tower gives extra feature sets
    (`MultiModalItem.features`) names the ones it consumes in `mm_feature_names`; then every
    step with `mm_embeds` also passes `mm_features`, name -> [M, width], row m of each the
    feature of the token `mm_embeds` row m is (so they sit at the rows `mm_mask` marks, in
    order): the features of exactly the item tokens this step computes, whether the step
    covers a whole item, part of one (a prefill chunk; a prefix-cache hit ending inside it) or
    input appended to a running request. A model naming none is never passed `mm_features`,
    and no step gathers any for it."""

    config: object
    mm_feature_names: tuple[str, ...] = ()
    head_matrices: tuple[StoredMatrix, StoredMatrix] | None = None
    weight_format: WeightFormat | None = None
    cpu_decoder: CpuDecoder | None = None  # None: the torch ops run (also set so by benches)
    weights_seen: WeightSnapshot | None = None  # the weights `prepare_weights` saw
    # (hidden states, their logits) of the last native step, made in the same call
    step_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    def extend_positions(
        self,
        cursor: LinearCursor | None,
        token_ids: torch.Tensor,
        items: Sequence[MultiModalItem],
        placements: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, LinearCursor]:
        """Positions of tokens appended after `cursor` (None: at a sequence's start) and the
        cursor after them; placements relative to `token_ids`. This default serves 1-D
        positions, which shift with the sequence before them; M-RoPE overrides it."""
        start = 0 if cursor is None else cursor.next_position
        positions, next_position = self.prompt_positions(token_ids, items, placements)
        return positions + start, LinearCursor(start + next_position)

    def native_stack(self) -> Stack | None:
        """The model as the native CPU decode step reads it; None: it has none."""
        return None

    def prepare_weights(self) -> None:
        """Make the prepared matrices and the native decoder from the weights as they are
        now, and remember which tensors those were (see `native_decode`)."""
        prepare_matrices(self)
        stack = self.native_stack()
        self.cpu_decoder = None if stack is None else bind(stack)
        self.weights_seen = WeightSnapshot(self)

    def native_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        mm_embeds: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """`forward`'s result from the native CPU decode step when this step is one it takes
        (decodes only, see `CpuDecoder.supports`), else None. Every forward calls it first, so
        here the weights are checked: if the model now holds other tensors than the prepared
        matrices and the decoder were made from (a reload, `.to()`, a replaced parameter),
        both are made again before anything reads them (falling back to torch where the kernel
        cannot serve the new weights, e.g. float64). The native step computes its rows' logits
        in the same call, kept for `head_logits`."""
        self._keep_step_logits(None)
        if self.weights_seen is not None and not self.weights_seen.current():
            log.info("the model's weights changed: rebuilding its matrices and native decode step")
            self.prepare_weights()
        native = self.cpu_decoder
        if (
            mm_embeds is None
            and native is not None
            and native.supports(input_ids, kv_caches, metadata)
        ):
            hidden, logits = native.decode(input_ids, positions, kv_caches, metadata, True)
            if logits is not None:
                self._keep_step_logits((hidden, logits))
            return hidden
        return None

    def _keep_step_logits(self, made: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        # in the instance's dictionary directly: `nn.Module.__setattr__` checks each assignment
        # against parameters, buffers and submodules, a cost seen in every decode step
        vars(self)["step_logits"] = made

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[S, vocab]` of `hidden` `[S, hidden]` through the LM head: those the
        native step made with `hidden` when `hidden` is the very tensor it returned (a step of
        decodes whose every row samples), else the head's product."""
        made = self.step_logits
        self._keep_step_logits(None)
        if made is not None and made[0] is hidden:
            return made[1]
        return vocab_logits(hidden, self.head_matrices or self.lm_head)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's KV cache: [2 (k, v), num_blocks, block_size, Hkv, D]."""
        return (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)


def empty_weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised frozen parameter; `from_checkpoint` replaces it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def set_weight(
    module: nn.Module, name: str, tensor: torch.Tensor, scale: torch.Tensor | None = None
) -> None:
    """Replace `module.<name>` by a frozen parameter holding `tensor` (no copy), and its int8
    per-column scales `<name>_scale` by `scale` (removed when None)."""
    setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    if scale is not None:
        setattr(module, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
    elif hasattr(module, f"{name}_scale"):
        delattr(module, f"{name}_scale")


def embedding_rows(
    input_ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `[N, hidden]` of an embedding `table` `[vocab, hidden]` (any strides, or a tied
    head's panels, see `head_table`; int8 times its per-row `scale`) for `input_ids` `[N]`, in
    `dtype`."""
    if table.dim() != 2:
        rows = panel_rows(table, input_ids).to(dtype)
    else:
        rows = F.embedding(input_ids, table).to(dtype)
    return rows if scale is None else rows.mul_(scale[input_ids, None].to(dtype))


def rotary_tables(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary angles [N, D/2] (float32) -> cos and signed sin `[N, 1, D]` in `dtype`.

    The sin table is negated on its first half so that rotating is
    `x * cos + roll(x, D/2) * sin` (roll swaps the halves), transformers' `rotate_half` form.
    """
    cos, sin = angles.cos(), angles.sin()
    cos = torch.cat((cos, cos), dim=-1)  # [N, D]
    sin = torch.cat((-sin, sin), dim=-1)  # [N, D]
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` [N, heads, D] with `rotary_tables`' [N, 1, D] tables."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def fused_qkv_attention(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    qk_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    **attention_options,
) -> torch.Tensor:
    """Attention from a fused projection `qkv` [N, (Hq + 2 Hkv) * D] -> [N, Hq * D].

    q and k heads are adjacent columns, so one `qk_transform` (e.g. a per-head norm) and one
    rotation cover both; the new k/v go into the paged cache before attending.
    """
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    num_qk_heads = num_heads + num_kv_heads
    qk = qkv[:, : num_qk_heads * head_dim].view(num_tokens, num_qk_heads, head_dim)
    if qk_transform is not None:
        qk = qk_transform(qk)
    query, key = rotate(qk, cos, sin).split((num_heads, num_kv_heads), dim=1)
    value = qkv[:, num_qk_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    attended = paged_attention(query, kv_cache, metadata, **attention_options)  # [N, Hq, D]
    return attended.reshape(num_tokens, -1)


def load_head(
    folder: str | os.PathLike[str],
    hidden_size: int,
    vocab_size: int,
    weight_format: WeightFormat,
    device: torch.device | str,
) -> nn.Module:
    """An untied checkpoint's `lm_head` as a (meta-built) `nn.Linear` holding its weight in
    its stored format, laid out for `head_layout` (and its int8 `weight_scale`)."""
    with torch.device("meta"):
        head = nn.Linear(hidden_size, vocab_size, bias=False)
    kept = () if weight_format.quantizes("lm_head") else ("weight",)
    formats = plan_formats(head, weight_format, {"weight": 0}, unquantized=kept, heads=("weight",))
    load_weights(head, folder, LM_HEAD_PREFIX, device=device, formats=formats)
    return head


def checkpoint_layout(vocab_size: int, hidden_size: int, layers: list[nn.Module]) -> nn.Module:
    """Meta-device modules named like a checkpoint's `language_model.*` tensors: the embedding,
    the decoder `layers` (see `checkpoint_layer`) and the final norm."""
    with torch.device("meta"):
        root = nn.Module()
        root.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        root.layers = nn.ModuleList(layers)
        root.norm = nn.RMSNorm(hidden_size)
    return root


def checkpoint_layer(
    hidden_size: int,
    intermediate_size: int,
    q_width: int,
    kv_width: int,
    *,
    qkv_bias: bool,
    norms: tuple[str, ...],
) -> nn.Module:
    """A meta-device decoder layer named like a checkpoint's: `self_attn.{q,k,v,o}_proj`,
    `mlp.{gate,up,down}_proj` and one RMSNorm per name in `norms`."""
    with torch.device("meta"):
        attn = nn.Module()
        attn.q_proj = nn.Linear(hidden_size, q_width, bias=qkv_bias)
        attn.k_proj = nn.Linear(hidden_size, kv_width, bias=qkv_bias)
        attn.v_proj = nn.Linear(hidden_size, kv_width, bias=qkv_bias)
        attn.o_proj = nn.Linear(q_width, hidden_size, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        layer = nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        for name in norms:
            setattr(layer, name, nn.RMSNorm(hidden_size))
    return layer


def fused_weight(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `[in, out]` weight (`matmul_layout`) of checkpoint-named `nn.Linear`s side by side
    (their outputs one after another), and their int8 scales likewise (None unless int8)."""
    transposed = [p.weight.T for p in linears]  # [in, out_i] views
    num_out = sum(part.shape[1] for part in transposed)
    first = transposed[0]
    pack = packing(first.dtype, first.device, first.shape[0], num_out)
    if pack is not None:
        weight = pack(transposed)  # side by side as it packs: one copy
    else:
        weight = matmul_layout(first if len(linears) == 1 else torch.cat(transposed, dim=1))
    scales = [scale_of(p, "weight") for p in linears]
    return weight, None if scales[0] is None else torch.cat(scales)


def fuse_projections(layer: nn.Module, stored: nn.Module) -> None:
    """Set `layer`'s fused `[in, out]` weights (and int8 scales) from a checkpoint-named layer:
    `qkv_weight` (q, k, v columns side by side), `o_weight`, `gate_up_weight` (gate, up) and
    `down_weight`. The stored layer's linear weights are dropped (its biases stay)."""
    attn, mlp = stored.self_attn, stored.mlp
    parts = {
        "qkv_weight": [attn.q_proj, attn.k_proj, attn.v_proj],
        "o_weight": [attn.o_proj],
        "gate_up_weight": [mlp.gate_proj, mlp.up_proj],
        "down_weight": [mlp.down_proj],
    }
    for name, linears in parts.items():
        set_weight(layer, name, *fused_weight(linears))
        for part in linears:  # released as soon as fused: one projection's copy at a time
            part.weight = None
            if hasattr(part, "weight_scale"):
                del part.weight_scale
        release_freed_memory()
