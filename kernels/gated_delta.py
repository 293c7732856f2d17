"""The gated delta rule in torch: chunked for prompts, one token at a time for decode.

A Gated DeltaNet head keeps a matrix state `S` `[k_dim, v_dim]`. Each token decays it by
`exp(g)` (g <= 0), then writes its value v under its key k with strength beta, replacing what
S held for k (the delta rule), and reads it with its query q:

    S = exp(g) S;   S += k (beta (v - k^T S))^T;   y = S^T q

q and k are L2-normalised and q is scaled by `k_dim ** -0.5` before (`normalized_qk`); a group
of value heads shares each key head. In float32 throughout, whatever the model computes in.

A prompt runs chunk by chunk (`chunked_gated_delta`): inside a chunk of C tokens the C
updates fold into a few products (the WY form: the unit lower-triangular system of the keys'
overlaps gives the corrected values `u` and the keys `w` that read the state), and the state
passes from chunk to chunk. A decode step (`gated_delta_step`) advances many sequences by one
token each. `gated_delta_with_states` splits a prompt where its state is to be saved (prefix
caching snapshots): a run restarting from one of those states computes what this one does
after it. On CUDA the chunked form runs as a Triton kernel (`gated_delta_triton`) where its
tiles fit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stillcut.kernels.mamba2 import split_scan

L2_EPS = 1e-6  # inside the square root of the L2 norm, as transformers (and FLA) add it


def normalized_qk(
    query: torch.Tensor, key: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k `[..., k_heads, k_dim]` -> float32 `[..., v_heads, k_dim]`: L2-normalised, q
    scaled by `k_dim ** -0.5`, each key head repeated for the value heads it serves."""
    repeat = num_v_heads // key.shape[-2]
    scale = query.shape[-1] ** -0.5
    query, key = (_l2_normalized(x.float()).repeat_interleave(repeat, dim=-2) for x in (query, key))
    return query * scale, key


def _l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def chunked_gated_delta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the rule, `chunk_size` tokens at a time.

    `query`, `key` `[L, H, Dk]` (as `normalized_qk` gives them), `value` `[L, H, Dv]`, `g` and
    `beta` `[L, H]`, `initial_state` `[H, Dk, Dv]` (None: zeros). Returns `y` `[L, H, Dv]` and
    the state after the last token, float32. A sequence shorter than a chunk is one chunk of
    its own length (the same sums, without the work on padding)."""
    length, num_heads, _ = key.shape
    chunk_size = min(chunk_size, length)
    pad = -length % chunk_size
    # [H, chunks, C, D] and [H, chunks, C]; padding has g = 0 (no decay) and beta = k = 0 (no
    # write), so the state after the padded sequence is the state after its L tokens
    q, k, v = (
        _chunked(F.pad(x.float(), (0, 0, 0, 0, 0, pad)), chunk_size) for x in (query, key, value)
    )
    g, beta = (
        _chunked(F.pad(x.float(), (0, 0, 0, pad))[..., None], chunk_size)[..., 0] for x in (g, beta)
    )
    decay_to = g.cumsum(-1)  # [H, c, C]: log decay from the chunk's start through token i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=g.device).tril()
    # pairwise[i, j] = decay from after token j through token i (i >= j), else 0
    pairwise = (decay_to[..., :, None] - decay_to[..., None, :]).masked_fill(~causal, -torch.inf)
    pairwise = pairwise.exp()  # [H, c, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # the WY form: (I + strictly-lower(beta_i k_i . k_j decay_ij)) [u | w] = [v beta | k beta decay]
    overlaps = (k_beta @ k.transpose(-1, -2)) * pairwise
    corrected = torch.linalg.solve_triangular(overlaps, v_beta, upper=False, unitriangular=True)
    readers = torch.linalg.solve_triangular(
        overlaps, k_beta * decay_to.exp()[..., None], upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * pairwise  # [H, c, C, C]: attention inside the chunk
    q_decayed = q * decay_to.exp()[..., None]
    k_to_end = k * (decay_to[..., -1:] - decay_to).exp()[..., None]
    chunk_decay = decay_to[..., -1].exp()[..., None, None]  # [H, c, 1, 1]
    state = (
        q.new_zeros(num_heads, q.shape[-1], v.shape[-1])
        if initial_state is None
        else initial_state.float().clone()
    )
    y = torch.empty_like(v)
    for chunk in range(q.shape[1]):
        fresh = corrected[:, chunk] - readers[:, chunk] @ state  # [H, C, Dv]: what S lacks
        y[:, chunk] = q_decayed[:, chunk] @ state + within[:, chunk] @ fresh
        state = state * chunk_decay[:, chunk] + k_to_end[:, chunk].transpose(-1, -2) @ fresh
    return y.flatten(1, 2)[:, :length].transpose(0, 1), state


def gated_delta_with_states(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    state_ends: list[int],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`chunked_gated_delta` split at `state_ends` (`split_scan`): `y` `[L, H, Dv]` and the
    states after each of those tokens, then the final state."""

    rule = _chunked_rule(key.device, key.shape[-1], value.shape[-1], chunk_size)

    def scan(query, key, value, g, beta, state):
        return rule(query, key, value, g, beta, chunk_size, state)

    return split_scan(scan, (query, key, value, g, beta), initial_state, state_ends)


def _chunked_rule(device: torch.device, k_dim: int, v_dim: int, chunk_size: int):
    """The Triton kernel on CUDA where its tiles fit (sides powers of two >= 16) and triton
    imports, else the torch reference."""
    fits = all(size >= 16 and size & (size - 1) == 0 for size in (k_dim, v_dim, chunk_size))
    if device.type == "cuda" and fits:
        try:
            from stillcut.kernels.gated_delta_triton import chunked_gated_delta_triton
        except ImportError:
            return chunked_gated_delta
        return chunked_gated_delta_triton
    return chunked_gated_delta


def gated_delta_step(
    state: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of D sequences: `state` `[D, H, Dk, Dv]`, `query`, `key` `[D, H, Dk]` (as
    `normalized_qk` gives them), `value` `[D, H, Dv]`, `g`, `beta` `[D, H]`. Returns `y`
    `[D, H, Dv]` and the new state, float32."""
    key, value = key.float()[..., None], value.float()
    state = state.float() * g.float().exp()[..., None, None]
    remembered = (state * key).sum(dim=-2)  # [D, H, Dv]: what S holds under k
    delta = (value - remembered) * beta.float()[..., None]
    state = state + key * delta[..., None, :]
    return (state * query.float()[..., None]).sum(dim=-2), state


def _chunked(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """`[L, H, D]` (L a multiple of chunk_size) -> `[H, L / chunk_size, chunk_size, D]`."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, chunk_size, x.shape[-1])
