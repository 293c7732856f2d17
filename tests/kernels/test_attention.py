"""Paged attention (torch backend and Triton kernel under the interpreter) against a dense
float64 reference built straight from the mask definition."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass, replace

import pytest
import torch

from stillcut.kernels import attention
from stillcut.kernels.attention import paged_attention, write_kv
from stillcut.kernels.attention_metadata import AttentionMetadata

HAS_TRITON = importlib.util.find_spec("triton") is not None
NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_TRITON)]


@dataclass
class Batch:
    """Requests of one step: full K/V per request, the paged cache, the step's queries."""

    query: torch.Tensor  # [N, H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # per request [ctx, Hkv, D]
    values: list[torch.Tensor]


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    mm_ranges: list[tuple[int, int, int]] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """`requests` are (context_len, query_len). Cached K/V go straight into shuffled blocks,
    the new tokens' K/V through `write_kv`; unused slots hold NaN so stray reads show."""
    generator = torch.Generator().manual_seed(seed)
    shuffle = random.Random(seed)
    blocks_per_request = [-(-ctx // block_size) for ctx, _ in requests]
    num_blocks = sum(blocks_per_request) + 3
    block_ids = list(range(num_blocks))
    shuffle.shuffle(block_ids)
    kv_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(kv_shape, float("nan"), dtype=dtype)
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)
    max_blocks = max(blocks_per_request)
    block_tables = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    keys, values, new_slots, queries, starts = [], [], [], [], [0]
    for b, (ctx, query_len) in enumerate(requests):
        table = [block_ids.pop() for _ in range(blocks_per_request[b])]
        block_tables[b, : len(table)] = torch.tensor(table)
        key = torch.randn(ctx, num_kv_heads, head_dim, generator=generator).to(dtype)
        value = torch.randn(ctx, num_kv_heads, head_dim, generator=generator).to(dtype)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        )
        cached = ctx - query_len
        flat_cache[0, slots[:cached]] = key[:cached]
        flat_cache[1, slots[:cached]] = value[:cached]
        new_slots.append(slots[cached:])
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=generator).to(dtype))
        starts.append(starts[-1] + query_len)
        keys.append(key)
        values.append(value)
    slot_mapping = torch.cat(new_slots)
    new_keys = torch.cat([key[ctx - q :] for key, (ctx, q) in zip(keys, requests, strict=True)])
    new_values = torch.cat([v[ctx - q :] for v, (ctx, q) in zip(values, requests, strict=True)])
    write_kv(new_keys, new_values, kv_cache, slot_mapping)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([ctx for ctx, _ in requests], dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max(q for _, q in requests),
        max_seq_len=max(ctx for ctx, _ in requests),
        mm_ranges=None if mm_ranges is None else torch.tensor(mm_ranges, dtype=torch.int32),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[ctx for ctx, _ in requests],
    )
    return Batch(torch.cat(queries), kv_cache, metadata, keys, values)


def reference(batch: Batch, scale: float, window=None, soft_cap=None) -> torch.Tensor:
    """Dense attention in float64 with the mask spelled out from its definition."""
    md = batch.metadata
    ranges = [] if md.mm_ranges is None else md.mm_ranges.tolist()
    starts = md.query_start_loc.tolist()
    outs = []
    for b, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        start, end = starts[b], starts[b + 1]
        ctx = key.shape[0]
        i = torch.arange(ctx - (end - start), ctx)[:, None]  # [Q, 1]
        j = torch.arange(ctx)[None, :]  # [1, ctx]
        mask = j <= i
        for rb, s, e in ranges:
            if rb == b:
                mask |= (s <= i) & (i < e) & (s <= j) & (j < e)
        if window is not None:  # transformers' Gemma 3: window AND (causal OR same item)
            mask &= i - j < window
        q = batch.query[start:end].double().transpose(0, 1)  # [H, Q, D]
        group = q.shape[0] // key.shape[1]
        k = key.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, D]
        v = value.double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale  # [H, Q, ctx]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append((probs @ v).transpose(0, 1))  # [Q, H, D]
    return torch.cat(outs)


def run(batch: Batch, backend: str, window=None, soft_cap=None) -> torch.Tensor:
    out = paged_attention(
        batch.query,
        batch.kv_cache,
        batch.metadata,
        scale=batch.query.shape[-1] ** -0.5,
        sliding_window=window,
        logits_soft_cap=soft_cap,
        backend=backend,
    )
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    return out


def check(batch: Batch, backend: str, atol=2e-5, **kwargs) -> torch.Tensor:
    out = run(batch, backend, **kwargs)
    expected = reference(batch, batch.query.shape[-1] ** -0.5, **kwargs)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)
    return out


PREFILL = [(13, 13), (7, 7)]
CHUNKED = [(21, 6), (10, 4)]
DECODE = [(9, 1), (17, 1), (1, 1), (32, 1)]
MIXED = [(20, 5), (11, 1), (8, 8), (30, 1)]
IDLE = [(5, 0), (9, 3), (4, 0), (7, 1)]  # requests with no token this step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "requests",
    [PREFILL, CHUNKED, DECODE, MIXED, IDLE],
    ids=["prefill", "chunked", "decode", "mixed", "idle"],
)
def test_causal_batches(backend, requests):
    check(make_batch(requests), backend)


def test_torch_backend_without_host_copies():
    batch = make_batch(MIXED, mm_ranges=[(0, 16, 20)])
    batch.metadata = replace(batch.metadata, query_start_loc_cpu=None, seq_lens_cpu=None)
    check(batch, "torch", window=6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(4, 2, 32, 8), (8, 1, 32, 8), (3, 3, 16, 16), (6, 2, 24, 5)],  # odd groups, dims, blocks
)
def test_gqa(backend, num_heads, num_kv_heads, head_dim, block_size):
    batch = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    check(batch, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_context_spans_several_key_tiles(backend):
    # Longer than the kernel's key tile, so its online softmax rescales across tiles.
    requests = [(150, 3), (200, 1), (90, 90)]
    batch = make_batch(requests, block_size=16, mm_ranges=[(0, 40, 152), (2, 10, 60)])
    check(batch, backend)
    check(batch, backend, window=70)


# Request 0 queries positions 12..19 of 20; request 2 is one whole prompt of 18 tokens.
ITEM_REQUESTS = [(20, 8), (15, 1), (18, 18)]
ITEMS = {
    "inside_query": [(0, 13, 18)],
    "straddles_query_start": [(0, 9, 15)],  # cached 9..11 plus new 12..14, one query chunk
    "in_the_past": [(0, 2, 8)],
    "several": [(0, 1, 6), (0, 13, 19), (2, 3, 9), (2, 12, 17), (1, 4, 10)],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ranges", ITEMS.values(), ids=ITEMS.keys())
def test_bidirectional_items(backend, ranges):
    check(make_batch(ITEM_REQUESTS, mm_ranges=ranges), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bidirectional_mask_is_exercised(backend):
    items = make_batch(ITEM_REQUESTS, mm_ranges=ITEMS["several"])
    causal = make_batch(ITEM_REQUESTS)
    differs = (run(items, backend) - run(causal, backend)).abs().amax(dim=(1, 2)) > 1e-3
    # Exactly the queries inside an item, before its last token, see keys a causal mask hides.
    expected = []
    for b, (ctx, query_len) in enumerate(ITEM_REQUESTS):
        for i in range(ctx - query_len, ctx):
            expected.append(any(rb == b and s <= i < e - 1 for rb, s, e in ITEMS["several"]))
    assert sum(expected) > 5
    assert differs.tolist() == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("requests", [MIXED, DECODE], ids=["mixed", "decode"])
def test_sliding_window(backend, requests):
    check(make_batch(requests), backend, window=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_with_items(backend):
    # Items longer than the window: the window hides an item's early tokens from its last
    # ones, while its later tokens stay visible to its first ones.
    ranges = [(0, 10, 18), (1, 2, 14), (2, 1, 4), (2, 5, 16)]
    requests = [(20, 8), (14, 1), (18, 18)]
    check(make_batch(requests, mm_ranges=ranges), backend, window=3)


@pytest.mark.parametrize("window", [None, 4])
def test_query_tiles_match_one_call(monkeypatch, window):
    # Chunks that need a mask run in query tiles; tiny tiles split items and windows.
    batch = make_batch([(30, 17), (19, 19)], mm_ranges=[(0, 14, 22), (1, 2, 9), (1, 12, 19)])
    whole = check(batch, "torch", window=window)
    monkeypatch.setattr(attention, "QUERY_TILE", 3)
    torch.testing.assert_close(run(batch, "torch", window=window), whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_cap(backend):
    batch = make_batch(MIXED, mm_ranges=[(0, 16, 20)])
    batch.query *= 4.0  # scores well past the cap, so capping changes the result
    capped = check(batch, backend, soft_cap=2.0, window=6)
    assert (capped - run(batch, backend, window=6)).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_query(backend):
    batch = make_batch(MIXED)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)  # like a qkv split
    batch.query = fused[:, : batch.query.shape[1]]
    assert not batch.query.is_contiguous()
    check(batch, backend)


# The interpreter's bf16 tl.dot is wrong, so there the kernel widens bf16 tiles before its dots
# (loads, casts and stores stay bf16); the bf16 dot itself is checked on GPU.
@pytest.mark.parametrize(
    "backend, dtype",
    [
        ("torch", torch.bfloat16),
        ("torch", torch.float16),
        pytest.param("triton", torch.float16, marks=NEEDS_TRITON),
        pytest.param("triton", torch.bfloat16, marks=NEEDS_TRITON),
    ],
)
def test_half_precision(backend, dtype):
    batch = make_batch(MIXED, num_heads=6, dtype=dtype, mm_ranges=[(2, 1, 5)])
    check(batch, backend, atol=2e-2 if dtype == torch.bfloat16 else 3e-3, window=7)


def test_long_prefill_chunks_attend_in_the_prefill_dtype():
    """A chunk past LONG_QUERY_ROWS attends in `prefill_dtype`: its rows are bf16 values, as
    close to float64 as bf16 attention is (`test_half_precision`'s bound); the short chunk and
    the decode beside it keep float32."""
    long_rows = attention.LONG_QUERY_ROWS + 8
    batch = make_batch([(long_rows + 5, long_rows), (12, 6), (9, 1)], block_size=16)
    batch.metadata.prefill_dtype = torch.bfloat16
    out = run(batch, "torch")
    expected = reference(batch, batch.query.shape[-1] ** -0.5)
    long, short = slice(0, long_rows), slice(long_rows, None)
    torch.testing.assert_close(out[short].double(), expected[short], rtol=0, atol=2e-5)
    torch.testing.assert_close(out[long].double(), expected[long], rtol=0, atol=2e-2)
    assert torch.equal(out[long], out[long].bfloat16().float())
    assert not torch.equal(out[short], out[short].bfloat16().float())


@NEEDS_TRITON
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_split_kv_decode_matches_torch(monkeypatch, dtype, atol):
    # Short contexts split as a long one does: several programs per kv head, some of them
    # past the end of the keys (empty), merged by log-sum-exp. On GPU the same at 16k tokens.
    triton_attention = pytest.importorskip("stillcut.kernels.paged_attention_triton")
    monkeypatch.setattr(triton_attention, "MIN_KEYS_PER_SPLIT", 16)
    batch = make_batch([(150, 1), (37, 1)], block_size=16, dtype=dtype, mm_ranges=[(0, 140, 152)])
    md = batch.metadata
    assert triton_attention.num_kv_splits(1, md.max_seq_len, 2, 2) == 8
    for options in ({}, {"window": 40, "soft_cap": 2.0}):
        out = check(batch, "triton", atol=atol, **options)
        torch.testing.assert_close(out, run(batch, "torch", **options), rtol=0, atol=atol)


def test_long_decodes_at_small_batches_split_the_keys():
    triton_attention = pytest.importorskip("stillcut.kernels.paged_attention_triton")
    splits = triton_attention.num_kv_splits
    assert splits(1, 16384, 1, 4) > 1  # a 16k-token decode at batch 1, 4 kv heads
    assert splits(1, 16384, 64, 4) == 1  # enough programs without splitting
    assert splits(1, 100, 1, 4) == 1  # too short to be worth a merge
    assert splits(8, 16384, 1, 4) == 1  # prefill rows already fill the tiles


def test_write_kv_places_tokens_at_their_slots():
    block_size, num_kv_heads, head_dim = 4, 2, 3
    kv_cache = torch.zeros(2, 9, block_size, num_kv_heads, head_dim)
    table = [5, 2, 7]
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(10, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(10, num_kv_heads, head_dim, generator=generator)
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(10)])
    write_kv(key, value, kv_cache, slots)
    torch.testing.assert_close(kv_cache[:, 5], torch.stack([key[0:4], value[0:4]]))
    torch.testing.assert_close(kv_cache[:, 2], torch.stack([key[4:8], value[4:8]]))
    torch.testing.assert_close(kv_cache[:, 7, :2], torch.stack([key[8:10], value[8:10]]))
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[table] = False
    assert not kv_cache[:, untouched].any() and not kv_cache[:, 7, 2:].any()


def test_auto_is_torch_on_cpu_and_bad_arguments_raise():
    batch = make_batch(PREFILL)
    torch.testing.assert_close(run(batch, "auto"), run(batch, "torch"), rtol=0, atol=0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        run(batch, "cuda")
    with pytest.raises(ValueError, match="sliding_window=0"):
        run(batch, "torch", window=0)
