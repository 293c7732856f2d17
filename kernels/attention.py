"""Paged attention for the language runner: one call per layer over a flat batch of requests.

K/V live in blocks `[2, num_blocks, block_size, num_kv_heads, head_dim]` addressed by block
tables. A step mixes prefill chunks and decodes; query token k of request b sits at sequence
position `seq_len_b - q_len_b + k`. Query i sees key j iff `i - j < window` and (`j <= i` or i
and j lie in the same bidirectional multimodal item): the mask transformers composes for
sliding-window models with bidirectional images, window AND (causal OR same image), so an image
longer than the window does not see its own tokens beyond it. Only the key span some query can
see is gathered (by slot, so unwritten slots are never read): a window bounds it from below.
Decodes run as one padded batch with the grouped query heads folded into SDPA's query axis. A
prefill chunk is one `is_causal` SDPA call when it starts at position 0 with a plain causal
mask, else query tiles with explicit masks, each over only the keys it can see. What to gather
and mask, for decodes and chunks alike, is worked out once per step (kept in the metadata's
`plans`) and reused by every layer. `auto` picks the Triton kernel on CUDA
(`paged_attention_triton`) and this torch backend elsewhere.
"""

from __future__ import annotations

from functools import partial
from itertools import pairwise
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from stillcut.kernels.attention_metadata import AttentionMetadata

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")
QUERY_TILE = 256  # query rows per SDPA call when a chunk needs an explicit mask
# A prefill chunk of more query rows attends in `AttentionMetadata.prefill_dtype`; fewer rows
# (verify steps, short chunks) are decode-like and keep float32, as the products do
# (`matmul.NATIVE_MAX_ROWS`).
LONG_QUERY_ROWS = 32


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' `key`/`value` `[N, num_kv_heads, head_dim]` at `slot_mapping` `[N]`
    in one layer's `kv_cache` `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert key.shape == value.shape == (slot_mapping.shape[0], *kv_cache.shape[3:]), (
        key.shape,
        value.shape,
        slot_mapping.shape,
        kv_cache.shape,
    )
    slots = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_slots, num_kv_heads, head_dim]
    slots[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Attention of `query` `[N, num_heads, head_dim]` over the paged context of its requests.

    The new tokens' K/V must already be in `kv_cache` (`write_kv`). `logits_soft_cap` applies
    `cap * tanh(scores / cap)` before masking. Returns `[N, num_heads, head_dim]` in the
    query's dtype; rows past `query_start_loc[-1]` (padding) are left unset. `backend`: "auto"
    (Triton on CUDA, torch elsewhere), "torch" or "triton".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be None or >= 1")
    if logits_soft_cap is not None and logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be None or > 0")
    assert query.dim() == 3 and kv_cache.dim() == 5 and kv_cache.shape[0] == 2
    assert query.shape[2] == kv_cache.shape[4], (query.shape, kv_cache.shape)
    assert query.shape[1] % kv_cache.shape[3] == 0, (query.shape, kv_cache.shape)
    if _use_triton(backend, query.device):
        from stillcut.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            query, kv_cache, metadata, scale, sliding_window, logits_soft_cap
        )
    return paged_attention_torch(query, kv_cache, metadata, scale, sliding_window, logits_soft_cap)


def _use_triton(backend: Backend, device: torch.device) -> bool:
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    if backend == "triton":
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _Span(NamedTuple):
    """Queries at positions `[query_start, query_end)` see keys in `[key_start, key_end)`;
    `items` are the bidirectional items holding one of those queries, clipped to the context."""

    query_start: int
    query_end: int
    key_start: int
    key_end: int
    items: list[tuple[int, int]]


def paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """The torch backend of `paged_attention` (same arguments); fp32 math on CPU but for
    long prefill chunks, which attend in `metadata.prefill_dtype` when it is set."""
    starts = metadata.query_start_loc_cpu
    starts = metadata.query_start_loc.tolist() if starts is None else starts
    seq_lens = metadata.seq_lens_cpu
    seq_lens = metadata.seq_lens.tolist() if seq_lens is None else seq_lens
    assert starts[-1] <= query.shape[0], (starts[-1], query.shape)  # padding rows stay unset
    dtype = torch.float32 if query.device.type == "cpu" else query.dtype
    attend = partial(_attend, scale=scale, soft_cap=logits_soft_cap)
    if "items" not in metadata.plans:
        metadata.plans["items"] = _items_by_request(metadata.mm_ranges, seq_lens)
    items: dict[int, list[tuple[int, int]]] = metadata.plans["items"]
    cache_shape = (kv_cache.shape[2], kv_cache.shape[3], query.device)  # block size, Hkv
    key = ("decode", sliding_window, *cache_shape)
    if key not in metadata.plans:
        metadata.plans[key] = _decode_plan(
            metadata, starts, seq_lens, items, kv_cache, sliding_window
        )
    plan: _DecodePlan | None = metadata.plans[key]
    if plan is not None and plan.num_decodes == len(seq_lens) == query.shape[0]:
        return _decode(query.to(dtype), kv_cache, plan, attend).to(query.dtype)  # decodes only
    out = torch.empty_like(query)  # [N, num_heads, head_dim]
    tiled = logits_soft_cap is not None  # the soft-capped path has no is_causal shortcut
    key = ("prefill", sliding_window, tiled, *cache_shape)
    if key not in metadata.plans:
        metadata.plans[key] = [
            _chunk_plan(
                metadata, b, start, end, seq_lens[b], items, kv_cache, sliding_window, tiled
            )
            for b, (start, end) in enumerate(pairwise(starts))
            if end - start > 1
        ]
    for chunk in metadata.plans[key]:
        rows = slice(chunk.start, chunk.end)
        long_chunk = chunk.end - chunk.start > LONG_QUERY_ROWS and metadata.prefill_dtype
        chunk_dtype = metadata.prefill_dtype if long_chunk and query.is_cpu else dtype
        _prefill_chunk(query[rows].to(chunk_dtype), kv_cache, chunk, attend, out[rows])
    if plan is not None:
        q = query.index_select(0, plan.rows).to(dtype)  # [num_decodes, num_heads, head_dim]
        out.index_copy_(0, plan.rows, _decode(q, kv_cache, plan, attend).to(out.dtype))
    return out


class _DecodePlan(NamedTuple):
    """The single-token queries of a step, as one padded batch: query `rows` [B], the KV-cache
    rows to gather `[B * Hkv * K]` (see `_kv_rows`) and the visibility `mask` `[B, 1, K]`,
    None when every decode sees every gathered key."""

    num_decodes: int
    rows: torch.Tensor
    kv_rows: torch.Tensor
    num_keys: int
    mask: torch.Tensor | None


def _decode_plan(metadata, starts, seq_lens, items, kv_cache, window) -> _DecodePlan | None:
    decodes = [b for b, (start, end) in enumerate(pairwise(starts)) if end - start == 1]
    if not decodes:
        return None
    device = metadata.block_tables.device
    spans = [_span(seq_lens[b] - 1, seq_lens[b], items.get(b, []), window) for b in decodes]
    key_start = torch.tensor([s.key_start for s in spans], device=device)  # [B]
    last = torch.tensor([s.query_start for s in spans], device=device)  # [B]
    # Each decode is its own query position, so it lies in at most one item.
    item_bounds = [s.items[0] if s.items else (0, 0) for s in spans]
    item_start, item_end = torch.tensor(item_bounds, device=device).T  # [B] each
    num_keys = max(s.key_end - s.key_start for s in spans)
    key_pos = key_start[:, None] + torch.arange(num_keys, device=device)  # [B, K]
    # Padding keys past a request's context re-read its last token: written, hence finite.
    gather_pos = torch.minimum(key_pos, last[:, None])  # [B, K]
    block_tables = metadata.block_tables[torch.tensor(decodes, device=device)]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    kv_rows = _kv_rows(block_tables, gather_pos, block_size, num_kv_heads)  # [B, Hkv, K]
    bounds = (x[:, None] for x in (last, item_start, item_end))
    mask = _visible(*bounds, key_pos, window)[:, None]  # [B, 1, K]
    rows = torch.tensor([starts[b] for b in decodes], device=device)
    return _DecodePlan(
        len(decodes), rows, kv_rows.flatten(), num_keys, None if bool(mask.all()) else mask
    )


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, attend) -> torch.Tensor:
    """Attention of the decodes' queries `[B, H, D]` -> `[B, H, D]`, with grouped heads folded
    into SDPA's query axis (no repeated K/V)."""
    num_decodes, num_heads, head_dim = q.shape
    k, v = _gather(kv_cache, plan.kv_rows, num_decodes, plan.num_keys, q.dtype)
    q = q.view(num_decodes, k.shape[1], -1, 1, head_dim)  # [B, Hkv, G, 1, D]
    return attend(q, k, v, plan.mask).reshape(num_decodes, num_heads, head_dim)


def _items_by_request(
    mm_ranges: torch.Tensor | None, seq_lens: list[int]
) -> dict[int, list[tuple[int, int]]]:
    """Each request's bidirectional items `(start, end)`, clipped to its context."""
    items: dict[int, list[tuple[int, int]]] = {}
    for b, start, end in [] if mm_ranges is None else mm_ranges.tolist():
        items.setdefault(b, []).append((start, min(end, seq_lens[b])))
    return items


def _span(
    query_start: int, query_end: int, items: list[tuple[int, int]], window: int | None
) -> _Span:
    # Items holding no query change nothing (an item in the past is seen causally). An item
    # only adds later keys: the window bounds every key from below, items included.
    live = [(s, e) for s, e in items if s < query_end and e > query_start]
    key_start = 0 if window is None else max(0, query_start - window + 1)
    key_end = max([query_end] + [e for _, e in live])
    return _Span(query_start, query_end, key_start, key_end, live)


class _ChunkPlan(NamedTuple):
    """One request's prefill chunk, rows `[start, end)` of the step: the KV-cache rows of the
    keys it sees (`[Hkv * K]`, see `_kv_rows`) and its query tiles, each (query rows, key
    columns, mask `[1, Q, K]` or None for SDPA's plain causal)."""

    start: int
    end: int
    kv_rows: torch.Tensor
    num_keys: int
    tiles: list[tuple[slice, slice, torch.Tensor | None]]


def _chunk_plan(metadata, b, start, end, context_len, items, kv_cache, window, tiled):
    """What every layer needs for request `b`'s chunk: worked out once per step. Tiles see
    only the keys they need when a single SDPA call could not skip any work (its `is_causal`
    does, but an explicit mask or, with `tiled`, the soft-capped path cannot)."""
    chunk = _span(context_len - (end - start), context_len, items.get(b, []), window)
    device = metadata.block_tables.device
    key_pos = torch.arange(chunk.key_start, chunk.key_end, device=device)  # [K]
    block_table = metadata.block_tables[b : b + 1]  # [1, max_num_blocks]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    kv_rows = _kv_rows(block_table, key_pos[None], block_size, num_kv_heads)  # [1, Hkv, K]
    spans = [chunk]
    if tiled or not _is_plain_causal(chunk, window):
        tile_starts = range(chunk.query_start, chunk.query_end, QUERY_TILE)
        spans = [
            _span(s, min(s + QUERY_TILE, chunk.query_end), chunk.items, window) for s in tile_starts
        ]
    tiles = [
        (
            slice(tile.query_start - chunk.query_start, tile.query_end - chunk.query_start),
            slice(tile.key_start - chunk.key_start, tile.key_end - chunk.key_start),
            None if _is_plain_causal(tile, window) else _tile_mask(tile, window, device),
        )
        for tile in spans
    ]
    return _ChunkPlan(start, end, kv_rows.flatten(), key_pos.numel(), tiles)


def _prefill_chunk(q, kv_cache, chunk: _ChunkPlan, attend, out) -> None:
    """Attention of one request's chunk `q` `[Q, H, D]` into `out` `[Q, H, D]`."""
    query_len, num_heads, head_dim = q.shape
    k, v = _gather(kv_cache, chunk.kv_rows, 1, chunk.num_keys, q.dtype)  # [1, Hkv, K, D]
    # [Q, H, D] -> [1, Hkv, G, Q, D]: query head h reads kv head h // G
    q = q.view(1, query_len, k.shape[1], -1, head_dim).permute(0, 2, 3, 1, 4)
    for rows, keys, mask in chunk.tiles:
        tile_out = attend(q[:, :, :, rows], k[:, :, keys], v[:, :, keys], mask)  # [1,Hkv,G,Q,D]
        out[rows] = tile_out[0].permute(2, 0, 1, 3).reshape(-1, num_heads, head_dim)


def _is_plain_causal(span: _Span, window: int | None) -> bool:
    """Queries and keys both cover `[0, n)` and the mask is causal: SDPA's `is_causal`."""
    no_window = window is None or span.query_end <= window
    return span.query_start == 0 and span.key_end == span.query_end and not span.items and no_window


def _tile_mask(span: _Span, window: int | None, device: torch.device) -> torch.Tensor:
    """`[1, Q, K]` bool visibility of the span's queries over its keys."""
    query_pos = torch.arange(span.query_start, span.query_end, device=device)  # [Q]
    key_pos = torch.arange(span.key_start, span.key_end, device=device)  # [K]
    item_start = torch.zeros_like(query_pos)  # [Q]
    item_end = torch.zeros_like(query_pos)  # [Q]
    for start, end in span.items:
        rows = slice(max(start, span.query_start) - span.query_start, end - span.query_start)
        item_start[rows], item_end[rows] = start, end
    bounds = (x[:, None] for x in (query_pos, item_start, item_end))
    return _visible(*bounds, key_pos[None], window)[None]


def _kv_rows(
    block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, num_kv_heads: int
) -> torch.Tensor:
    """Rows `[R, Hkv, K]` of a layer's `kv_cache.view(2, -1, head_dim)` holding the heads of
    sequence `positions` `[R, K]` of the `block_tables` rows, head-major (the layout matmul
    wants)."""
    block_ids = block_tables.gather(1, positions // block_size)  # [R, K]
    slots = block_ids.long() * block_size + positions % block_size  # [R, K]
    heads = torch.arange(num_kv_heads, device=positions.device)[:, None]  # [Hkv, 1]
    return slots[:, None] * num_kv_heads + heads  # [R, Hkv, K]


def _gather(kv_cache, kv_rows, num_requests, num_keys, dtype):
    """K and V `[R, Hkv, K, D]` (contiguous, in `dtype`) at a plan's `kv_rows`."""
    head_dim, num_kv_heads = kv_cache.shape[4], kv_cache.shape[3]
    # index_select copies whole rows; advanced indexing copies element by element (2x slower).
    kv = torch.index_select(kv_cache.view(2, -1, head_dim), 1, kv_rows)
    kv = kv.view(2, num_requests, num_kv_heads, num_keys, head_dim).to(dtype)
    return kv[0], kv[1]


def _visible(query_pos, item_start, item_end, key_pos, window: int | None) -> torch.Tensor:
    """Which keys each query sees: `[..., Q, 1]` query positions and item bounds against
    `[..., 1, K]` key positions give `[..., Q, K]` bool."""
    visible = (key_pos <= query_pos) | ((item_start <= key_pos) & (key_pos < item_end))
    if window is not None:
        visible &= query_pos - key_pos < window
    return visible


def _attend(q, k, v, mask, *, scale: float, soft_cap: float | None) -> torch.Tensor:
    """q `[R, Hkv, G, Q, D]`, k/v `[R, Hkv, K, D]`, mask `[R, Q, K]` bool or None for plain
    causal with Q == K; returns `[R, Hkv, G, Q, D]`."""
    _, num_kv_heads, group, query_len, _ = q.shape
    if soft_cap is not None:
        q = q.flatten(2, 3)  # [R, Hkv, G * Q, D]: plain batched matmuls, no repeated K/V
        scores = torch.matmul(q, k.transpose(-1, -2)).unflatten(2, (group, query_len)) * scale
        scores = soft_cap * torch.tanh(scores / soft_cap)  # [R, Hkv, G, Q, K]
        if mask is None:
            mask = torch.ones(1, query_len, query_len, dtype=torch.bool, device=q.device).tril()
        scores.masked_fill_(~mask[:, None, None], float("-inf"))
        probs = scores.float().softmax(-1).to(v.dtype)
        out = torch.matmul(probs.flatten(2, 3), v)  # [R, Hkv, G * Q, D]
        return out.unflatten(2, (group, query_len))
    if query_len == 1:
        # The grouped heads of one position share its mask: fold them into the query axis, so
        # SDPA needs neither GQA support nor repeated K/V.
        q = q.flatten(2, 3)  # [R, Hkv, G, D]
        mask = None if mask is None else mask[:, None]  # [R, 1, 1, K]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out.unflatten(2, (group, 1))
    out = F.scaled_dot_product_attention(
        q.flatten(1, 2),  # [R, H, Q, D]
        k,
        v,
        attn_mask=None if mask is None else mask[:, None],
        is_causal=mask is None,
        scale=scale,
        enable_gqa=group > 1,
    )  # [R, H, Q, D]
    return out.unflatten(1, (num_kv_heads, group))
