"""Triton chunked gated delta rule: one sequence, every head, in one launch (CUDA's prompt path).

The torch reference is `gated_delta.chunked_gated_delta` (same inputs, same outputs). The rule
updates each column of a head's state `S` `[Dk, Dv]` independently of the others (a token's
read `k^T S` and its write touch a column through that column alone), so a program owns one
head and one block of `BLOCK_V` value columns: its slice of S stays in registers while it walks
the sequence chunk by chunk. Per chunk of `CHUNK` tokens it forms the keys' overlaps
`beta_i (k_i . k_j) decay_ij` (strictly lower), inverts `I + overlaps` by forward substitution
on the register tile (one row per iteration, rows above already final), and from the WY form
computes the chunk's outputs and the state after it with `tl.dot`s in full float32
(`input_precision="ieee"`: TF32 would lose the parity the tests hold). Padding past the
sequence loads as g = 0, beta = 0, k = 0: no decay, no write. Import lazily: this module needs
triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_DOT_SIZE = 16  # tl.dot needs every tile side >= 16 on GPU


@triton.jit
def _gated_delta_kernel(
    query_ptr,  # [L, H, DK] float32, contiguous
    key_ptr,  # [L, H, DK]
    value_ptr,  # [L, H, DV]
    g_ptr,  # [L, H]
    beta_ptr,  # [L, H]
    state_ptr,  # [H, DK, DV]: read as the initial state (if HAS_STATE), then the final one
    out_ptr,  # [L, H, DV]
    length,
    num_heads,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    head = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    dims = tl.arange(0, DK)  # [DK]
    steps = tl.arange(0, CHUNK)  # [C]
    state_offsets = head * DK * DV + dims[:, None] * DV + columns[None, :]  # [DK, BV]
    if HAS_STATE:
        state = tl.load(state_ptr + state_offsets)
    else:
        state = tl.zeros((DK, BLOCK_V), dtype=tl.float32)
    causal = steps[:, None] >= steps[None, :]  # [C, C]
    below = steps[:, None] > steps[None, :]
    identity = tl.where(steps[:, None] == steps[None, :], 1.0, 0.0)
    for start in range(0, length, CHUNK):
        tokens = start + steps  # [C]
        valid = tokens < length
        rows_k = (tokens[:, None] * num_heads + head) * DK + dims[None, :]  # [C, DK]
        rows_v = (tokens[:, None] * num_heads + head) * DV + columns[None, :]  # [C, BV]
        query = tl.load(query_ptr + rows_k, mask=valid[:, None], other=0.0)
        key = tl.load(key_ptr + rows_k, mask=valid[:, None], other=0.0)
        value = tl.load(value_ptr + rows_v, mask=valid[:, None], other=0.0)
        g = tl.load(g_ptr + tokens * num_heads + head, mask=valid, other=0.0)  # [C]
        beta = tl.load(beta_ptr + tokens * num_heads + head, mask=valid, other=0.0)
        decay_to = tl.cumsum(g, axis=0)  # [C]: log decay from the chunk's start through i
        pairwise = tl.exp(tl.where(causal, decay_to[:, None] - decay_to[None, :], -float("inf")))
        key_t = tl.trans(key)  # [DK, C]
        overlaps = tl.dot(key, key_t, input_precision="ieee") * pairwise * beta[:, None]
        overlaps = tl.where(below, overlaps, 0.0)
        # (I + overlaps)^-1 row by row: row i = e_i - overlaps_i . (rows above, final)
        inverse = identity
        for i in range(1, CHUNK):
            row = tl.sum(tl.where(steps[:, None] == i, overlaps, 0.0), axis=0)  # [C]
            solved = tl.sum(row[:, None] * inverse, axis=0)  # [C]
            inverse = tl.where(steps[:, None] == i, identity - solved[None, :], inverse)
        decayed = tl.exp(decay_to)  # [C]
        corrected = tl.dot(inverse, value * beta[:, None], input_precision="ieee")  # [C, BV]
        readers = tl.dot(inverse, key * (beta * decayed)[:, None], input_precision="ieee")
        fresh = corrected - tl.dot(readers, state, input_precision="ieee")  # [C, BV]
        within = tl.dot(query, key_t, input_precision="ieee") * pairwise  # [C, C]
        within = tl.where(causal, within, 0.0)
        out = tl.dot(query * decayed[:, None], state, input_precision="ieee")
        out += tl.dot(within, fresh, input_precision="ieee")
        tl.store(out_ptr + rows_v, out, mask=valid[:, None])
        last = tl.sum(tl.where(steps == CHUNK - 1, decay_to, 0.0), axis=0)  # padding adds 0
        to_end = tl.exp(last - decay_to)  # [C]
        state = state * tl.exp(last)
        state += tl.dot(tl.trans(key * to_end[:, None]), fresh, input_precision="ieee")
    tl.store(state_ptr + state_offsets, state)


def chunked_gated_delta_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_gated_delta` on the GPU: `query`, `key` `[L, H, Dk]`, `value` `[L, H, Dv]`, `g`,
    `beta` `[L, H]`, `initial_state` `[H, Dk, Dv]` (None: zeros). Returns `y` `[L, H, Dv]` and
    the final state, float32. Dk, Dv and `chunk_size` must be powers of two >= 16."""
    length, num_heads, k_dim = key.shape
    v_dim = value.shape[-1]
    for name, size in (("k_dim", k_dim), ("v_dim", v_dim), ("chunk_size", chunk_size)):
        assert size >= MIN_DOT_SIZE and size & (size - 1) == 0, f"{name}={size}"
    assert query.shape == key.shape and value.shape[:2] == (length, num_heads), value.shape
    assert g.shape == beta.shape == (length, num_heads), (g.shape, beta.shape)
    query, key, value, g, beta = (x.float().contiguous() for x in (query, key, value, g, beta))
    state = (
        torch.empty(num_heads, k_dim, v_dim, device=key.device)
        if initial_state is None
        else initial_state.float().clone().contiguous()
    )
    assert state.shape == (num_heads, k_dim, v_dim), state.shape
    out = torch.empty(length, num_heads, v_dim, device=key.device)
    block_v = min(v_dim, 64)
    grid = (num_heads, v_dim // block_v)
    _gated_delta_kernel[grid](
        query,
        key,
        value,
        g,
        beta,
        state,
        out,
        length,
        num_heads,
        DK=k_dim,
        DV=v_dim,
        BLOCK_V=block_v,
        CHUNK=chunk_size,
        HAS_STATE=initial_state is not None,
    )
    return out, state
