"""Triton paged attention: prefill chunks and decodes of one step in a single launch.

A program owns `BLOCK_Q` query tokens of one request and one kv head, i.e. `BLOCK_Q` tokens x
the `GROUP` query heads sharing that kv head, stacked as the rows of one tile so GQA reads each
K/V tile once. Programs are numbered request after request (`query_start_loc[b] // BLOCK_Q + b`
is request b's first), so the grid needs only host-known sizes and each program finds its
request by binary search. It walks the keys its rows can see, reading them through the block
table one key at a time (any block size), with an online softmax accumulated in fp32. Masks:
window AND (causal OR same bidirectional item), then the soft cap. Items are passed per request
in CSR form; a row's item, if any, is found once before the key loop.

Split-KV: a decode-only step with few requests would leave most of the GPU idle (one program
per request and kv head walking a long context), so its key span is cut into `NUM_SPLITS`
pieces of whole key tiles, one program each, found on the device from the sequence length (a
fixed split count serves every length, so a captured graph stays valid as contexts grow).
Each writes its normalised partial output and log-sum-exp; `_merge_splits_kernel` weighs them
together. Import lazily: this module needs triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from stillcut.kernels.attention_metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_DOT_SIZE = 16  # tl.dot needs every tile side >= 16 on GPU
MIN_KEYS_PER_SPLIT = 256  # below this a split's merge costs more than its parallelism brings
MAX_KV_SPLITS = 16
TARGET_PROGRAMS = 256  # about two waves of programs on a large GPU (an H100/H200 has 132 SMs)


@triton.jit
def _find_request(query_start_loc_ptr, num_requests, program, BLOCK_Q: tl.constexpr):
    """The request whose programs include `program`: the last b with first program <= it."""
    low = program * 0
    high = low + num_requests
    while low < high:
        mid = (low + high) // 2
        first_program = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_program <= program
        low = tl.where(go_right, mid + 1, low)
        high = tl.where(go_right, high, mid)
    return low - 1


@triton.jit
def _tanh(x):
    # exp of a non-positive argument cannot overflow
    decay = tl.exp(-2.0 * tl.abs(x))
    magnitude = (1.0 - decay) / (1.0 + decay)
    return tl.where(x >= 0, magnitude, -magnitude)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [N, H, D]
    partial_out_ptr,  # [N, H, NUM_SPLITS, D] fp32, read only with NUM_SPLITS > 1
    partial_lse_ptr,  # [N, H, NUM_SPLITS] fp32, likewise
    query_ptr,  # [N, H, D], unit stride on D
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # same layout as the keys
    block_tables_ptr,  # [B, max_num_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    item_offsets_ptr,  # [B + 1] int32, CSR offsets into items
    items_ptr,  # [R, 2] int32 (start, end), grouped by request
    num_requests,
    num_heads,
    scale,
    soft_cap,
    window,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    BLOCK_SIZE: tl.constexpr,  # of the KV cache; fixed per engine, so no extra compiles
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_ITEMS: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # widen tiles before tl.dot (the interpreter's bf16 dot is wrong)
    NUM_SPLITS: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = _find_request(query_start_loc_ptr, num_requests, program, BLOCK_Q)
    query_begin = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_begin
    query_block = program - (query_begin // BLOCK_Q + request)
    if query_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + request)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # row = token * GROUP_PAD + head in group
    token = query_block * BLOCK_Q + rows // GROUP_PAD  # within the request
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (token < query_len) & (rows % GROUP_PAD < GROUP)
    query_pos = context_len - query_len + token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    row_offset = (query_begin + token).to(tl.int64)
    query_rows = query_ptr + row_offset * stride_query_token + head * stride_query_head
    q = tl.load(
        query_rows[:, None] + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # Items of one request are disjoint, so each query lies in at most one: [start, end).
    item_start = tl.zeros_like(query_pos)
    item_end = tl.zeros_like(query_pos)
    if HAS_ITEMS:
        for item in range(
            tl.load(item_offsets_ptr + request), tl.load(item_offsets_ptr + request + 1)
        ):
            start = tl.load(items_ptr + 2 * item)
            end = tl.minimum(tl.load(items_ptr + 2 * item + 1), context_len)
            inside = (start <= query_pos) & (query_pos < end)
            item_start = tl.where(inside, start, item_start)
            item_end = tl.where(inside, end, item_end)

    # The span of keys any row sees: from its window start (or 0) to it or its item's end.
    lowest = tl.zeros_like(query_pos)
    if HAS_WINDOW:
        lowest = query_pos - window + 1
    key_begin = tl.maximum(tl.min(tl.where(row_valid, lowest, context_len), 0), 0)
    key_end = tl.max(tl.where(row_valid, tl.maximum(query_pos + 1, item_end), 0), 0)
    if NUM_SPLITS > 1:
        split_len = tl.cdiv(tl.cdiv(key_end - key_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        key_begin = key_begin + split * split_len
        key_end = tl.minimum(key_end, key_begin + split_len)  # empty for the last splits

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + request.to(tl.int64) * stride_block_table
    for tile_start in range(key_begin, key_end, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < key_end
        block_id = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        slot = (
            block_id.to(tl.int64) * stride_cache_block
            + (key_pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )  # [BLOCK_N]
        k_mask = dim_valid[:, None] & key_valid[None, :]
        k = tl.load(key_cache_ptr + slot[None, :] + dims[:, None], mask=k_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFT_CAP:
            scores = soft_cap * _tanh(scores / soft_cap)
        visible = key_pos[None, :] <= query_pos[:, None]
        if HAS_ITEMS:
            visible |= (item_start[:, None] <= key_pos[None, :]) & (
                key_pos[None, :] < item_end[:, None]
            )
        if HAS_WINDOW:
            visible &= query_pos[:, None] - key_pos[None, :] < window
        visible &= key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Rows with nothing visible yet keep m = -inf; shift them by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_mask = key_valid[:, None] & dim_valid[None, :]
        v = tl.load(value_cache_ptr + slot[:, None] + dims[None, :], mask=v_mask, other=0.0)
        if DOT_IN_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # [BLOCK_M, BLOCK_D]
    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out_rows = out_ptr + row_offset * stride_out_token + head * stride_out_head
        tl.store(out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        partial = (row_offset * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
        has_keys = l_i > 0.0
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [N, H, D]
    partial_out_ptr,  # [N, H, NUM_SPLITS, D] fp32
    partial_lse_ptr,  # [N, H, NUM_SPLITS] fp32
    num_heads,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One (token, head): the splits' outputs weighted by exp(lse - max lse)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    first = (token * num_heads + head) * NUM_SPLITS
    lse = tl.load(partial_lse_ptr + first + splits)  # [NUM_SPLITS]
    lse_max = tl.max(lse, 0)
    # Every row sees at least its own key, so some split is non-empty and lse_max is finite.
    weight = tl.exp(lse - lse_max)  # [NUM_SPLITS], 0 for empty splits
    rows = partial_out_ptr + (first + splits)[:, None] * HEAD_DIM + dims[None, :]
    partial = tl.load(rows, mask=dim_valid[None, :], other=0.0)  # [NUM_SPLITS, BLOCK_D]
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)  # [BLOCK_D]
    out_row = out_ptr + token * stride_out_token + head * stride_out_head
    tl.store(out_row + dims, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


def _items_csr(mm_ranges: torch.Tensor, num_requests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, 3]` rows (b, start, end) -> offsets `[B + 1]` and items `[R, 2]`, without a sync."""
    request = mm_ranges[:, 0].contiguous()
    order = torch.sort(request, stable=True).indices
    ranges = mm_ranges[order]  # [R, 3], grouped by request
    bounds = torch.arange(num_requests + 1, dtype=request.dtype, device=request.device)
    offsets = torch.searchsorted(ranges[:, 0].contiguous(), bounds, out_int32=True)
    return offsets, ranges[:, 1:].to(torch.int32).contiguous()


def _check_inputs(query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> None:
    num_requests = md.seq_lens.shape[0]
    assert query.dim() == 3 and query.stride(2) == 1, (query.shape, query.stride())
    assert query.dtype in SUPPORTED_DTYPES, f"query dtype {query.dtype} not in {SUPPORTED_DTYPES}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.is_contiguous(), f"kv_cache must be contiguous, strides {kv_cache.stride()}"
    assert kv_cache.dtype == query.dtype, (kv_cache.dtype, query.dtype)
    assert kv_cache.shape[4] == query.shape[2], (kv_cache.shape, query.shape)
    assert query.shape[1] % kv_cache.shape[3] == 0, (query.shape, kv_cache.shape)
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        tensor = getattr(md, name)
        assert tensor.dtype == torch.int32, f"{name}: expected int32, got {tensor.dtype}"
        assert tensor.device == query.device, (name, tensor.device, query.device)
        assert tensor.stride(-1) == 1, f"{name}: last stride must be 1, got {tensor.stride()}"
    assert md.query_start_loc.shape == (num_requests + 1,), md.query_start_loc.shape
    assert md.block_tables.shape[0] == num_requests, md.block_tables.shape
    assert md.mm_ranges is None or md.mm_ranges.device == query.device, md.mm_ranges.device


def num_kv_splits(
    max_query_len: int, max_seq_len: int, num_requests: int, num_kv_heads: int
) -> int:
    """Programs per (request, kv head) of a step: a power of two, more than 1 only for
    decode-only steps whose requests and heads alone would not fill the GPU. `max_seq_len`
    is an upper bound (a captured graph passes the longest context it will meet)."""
    if max_query_len > 1:
        return 1
    by_length = triton.cdiv(max_seq_len, MIN_KEYS_PER_SPLIT)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(1, num_requests * num_kv_heads))
    wanted = min(MAX_KV_SPLITS, by_length, by_occupancy)
    return 1 << (wanted.bit_length() - 1)  # round down to a power of two


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """The Triton backend of `paged_attention` (same arguments); fp32 accumulation."""
    _check_inputs(query, kv_cache, metadata)
    num_tokens, num_heads, head_dim = query.shape
    num_requests = metadata.seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim))
    # Decode-only steps want short row tiles; prefill amortises each K/V tile over more rows.
    block_m = MIN_DOT_SIZE if metadata.max_query_len <= 1 else (64 if block_d <= 128 else 32)
    block_m = max(block_m, group_pad)
    block_n = 64 if block_d <= 128 else 32
    block_q = block_m // group_pad
    has_items = metadata.mm_ranges is not None and metadata.mm_ranges.shape[0] > 0
    if has_items:
        if "items_csr" not in metadata.plans:  # once per step, not per layer
            metadata.plans["items_csr"] = _items_csr(metadata.mm_ranges, num_requests)
        item_offsets, items = metadata.plans["items_csr"]
    else:
        item_offsets = items = metadata.query_start_loc  # never read
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_splits = num_kv_splits(
        metadata.max_query_len, metadata.max_seq_len, num_requests, num_kv_heads
    )
    partial_out = partial_lse = out  # never read with one split
    if num_splits > 1:
        partial_shape = (num_tokens, num_heads, num_splits)
        partial_out = torch.empty(*partial_shape, head_dim, dtype=torch.float32, device=out.device)
        partial_lse = torch.empty(partial_shape, dtype=torch.float32, device=out.device)
    grid = (num_tokens // block_q + num_requests, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out,
        partial_out,
        partial_lse,
        query,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        item_offsets,
        items,
        num_requests,
        num_heads,
        float(scale),
        float(logits_soft_cap or 0.0),
        int(sliding_window or 0),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        metadata.block_tables.stride(0),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        HAS_ITEMS=has_items,
        HAS_SOFT_CAP=logits_soft_cap is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_lse,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
        )
    return out
