"""Mamba2 in torch for the runner's flat batches: causal conv and selective scan with state.

A Mamba2 layer keeps, per running request, the last `K - 1` inputs of its depthwise causal
conv and its SSM state `[heads, head_dim, state_size]`; the runner holds both in one row per
request (`RecurrentMetadata`). A prompt chunk runs the conv over its tokens after the stored
inputs and the chunked SSD scan (Mamba2's state-space duality: a masked quadratic form inside
chunks of `chunk_size`, a recurrence across them) from the stored state, then stores the new
ones, so a prompt split across steps gives what one pass would. A decode step advances every
decoding request by one token at once. A request whose context starts at token 0 (new, or
recomputed after preemption) starts from zeros, whatever its row held before. A step may also
ask for the state after some of a request's tokens to be saved into snapshot slots (hybrid
prefix caching): a chunk's scan is then split at those tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RecurrentMetadata:
    """Built by the runner once per step for models with recurrent layers; shared by every
    recurrent layer. Per scheduled request b, in batch order: its tokens are
    `[query_start_loc_cpu[b], query_start_loc_cpu[b + 1])` of the flat batch, its state row
    is `state_rows_cpu[b]`, and `fresh[b]` says its state starts from zero this step (its first
    computed token is token 0).

    `states[layer_id]` are the runner's persistent state tensors of that layer, each
    `[max_num_reqs, *shape]`. `prompt_token_mask` marks the scheduled tokens that belong to
    their request's prompt (each request's come first). `captures[b]` lists `(num_tokens,
    slot)`: save the state after request b's first `num_tokens` scheduled tokens into slot
    `slot` of `snapshots[layer_id]` (tensors `[num_slots, *shape]`), ascending.

    Speculative decoding: `verifying[b]` says request b scores drafts this step; its tokens
    (its last sampled token, then the drafts) advance its states one position at a time
    (`verify_positions`), and the states after position j are also written to slot
    `row * draft_stride + j` of `draft_states[layer_id]`, so that the runner can restore the
    state after the last accepted token. Its captures save the state after position 0 only.
    """

    states: Mapping[int, tuple[torch.Tensor, ...]]
    state_rows_cpu: list[int]
    fresh: list[bool]
    query_start_loc_cpu: list[int]
    prompt_token_mask: torch.Tensor  # [N] bool, on the model's device
    snapshots: Mapping[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    captures: list[list[tuple[int, int]]] = field(default_factory=list)
    verifying: list[bool] = field(default_factory=list)
    draft_states: Mapping[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    draft_stride: int = 0

    @cached_property
    def one_token_steps(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The requests that advance a stored state by one token: their token indices and
        state rows `[D]` (on the device), and the batch indices of every other request (prompt
        chunks, fresh requests), which run the chunked scan."""
        tokens, rows, chunks = [], [], []
        for request, row in enumerate(self.state_rows_cpu):
            if self._steps_one_token(request):
                tokens.append(self.query_start_loc_cpu[request])
                rows.append(row)
            elif not self._verifies(request):
                chunks.append(request)
        tokens, rows = self._on_device([tokens, rows])
        return tokens, rows, chunks

    @cached_property
    def one_token_captures(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Of the one-token steps (in `one_token_steps` order), which save their new state:
        their indices `[S]` and snapshot slots `[S]` (on the device); None when none do."""
        index, slots, num_steps = [], [], 0
        for request, captures in enumerate(self.captures):
            if self._steps_one_token(request):
                index.extend(num_steps for _ in captures)
                slots.extend(slot for _, slot in captures)
                num_steps += 1
        return tuple(self._on_device([index, slots])) if slots else None

    @cached_property
    def verify_positions(self) -> list[VerifyPosition]:
        """Position j of every verifying request with a token there, for j = 0, 1, ... (the
        positions advance in turn: each starts from the states the one before left)."""
        starts, positions = self.query_start_loc_cpu, []
        verifying = [b for b in range(len(self.state_rows_cpu)) if self._verifies(b)]
        length = max((starts[b + 1] - starts[b] for b in verifying), default=0)
        for j in range(length):
            at = [b for b in verifying if starts[b] + j < starts[b + 1]]
            rows = [self.state_rows_cpu[b] for b in at]
            index, slots = [], []
            if j == 0 and self.captures:
                for k, b in enumerate(at):
                    index.extend(k for _ in self.captures[b])
                    slots.extend(slot for _, slot in self.captures[b])
            tokens, rows, drafts = self._on_device(
                [[starts[b] + j for b in at], rows, [row * self.draft_stride + j for row in rows]]
            )
            captures = tuple(self._on_device([index, slots])) if slots else None
            positions.append(VerifyPosition(tokens, rows, drafts, captures))
        return positions

    def _verifies(self, request: int) -> bool:
        return bool(self.verifying) and self.verifying[request]

    def _steps_one_token(self, request: int) -> bool:
        starts = self.query_start_loc_cpu
        one = starts[request + 1] - starts[request] == 1 and not self.fresh[request]
        return one and not self._verifies(request)

    def _on_device(self, lists: list[list[int]]) -> torch.Tensor:
        """Equal-length lists of ints as one long tensor `[len(lists), n]` on the device."""
        return torch.tensor(lists, dtype=torch.long, device=self.prompt_token_mask.device)


class VerifyPosition(NamedTuple):
    """One position of the verifying requests that have a token there: the token indices,
    their state rows and draft-state slots `[V]`, and which of them save a snapshot there
    (their indices and snapshot slots, or None), all on the device."""

    tokens: torch.Tensor
    rows: torch.Tensor
    draft_slots: torch.Tensor
    captures: tuple[torch.Tensor, torch.Tensor] | None


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence `x` `[L, C]` after the `K - 1` inputs
    `conv_state` `[C, K - 1]` (None: zeros), SiLU applied. `weight` `[C, K]`.
    Returns the output `[L, C]` and the new state `[C, K - 1]`."""
    num_taps = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], num_taps - 1)
    inputs = torch.cat([conv_state.to(x.dtype), x.T], dim=1)  # [C, K - 1 + L]
    out = F.conv1d(inputs[None], weight[:, None, :], bias, groups=weight.shape[0])[0]  # [C, L]
    return F.silu(out.T), inputs[:, inputs.shape[1] - (num_taps - 1) :]


def conv_state_after(
    conv_state: torch.Tensor | None, x: torch.Tensor, num_tokens: int, num_taps: int
) -> torch.Tensor:
    """The conv state `[C, K - 1]` after the first `num_tokens` of `x` `[L, C]`, which followed
    `conv_state` (None: zeros): the last `K - 1` inputs up to there."""
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], num_taps - 1)
    inputs = torch.cat([conv_state.to(x.dtype), x[:num_tokens].T], dim=1)  # [C, K - 1 + n]
    return inputs[:, inputs.shape[1] - (num_taps - 1) :]


def causal_conv1d_step(
    x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of D sequences: `x` `[D, C]` after `conv_states` `[D, C, K - 1]`.
    Returns SiLU(conv) `[D, C]` and the new states `[D, C, K - 1]`."""
    window = torch.cat([conv_states.to(x.dtype), x[:, :, None]], dim=2)  # [D, C, K]
    out = torch.einsum("dck,ck->dc", window, weight)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, :, 1:]


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of one sequence, chunk by chunk, in float32.

    `x` `[L, H, P]`, `dt` `[L, H]` (discretised: softplus and clamp applied), `A` `[H]`
    (negative), `B`/`C` `[L, G, N]` (groups shared by `H / G` heads), `D` `[H]`,
    `initial_state` `[H, P, N]` (None: zeros). Returns `y` `[L, H, P]` and the final state.
    """
    length, num_heads, _ = x.shape
    repeat = num_heads // B.shape[1]
    # a sequence shorter than a chunk is one chunk of its own length: the same sums, without
    # the quadratic work on padding (short segments between snapshots are common)
    chunk_size = min(chunk_size, length)
    pad = (-length) % chunk_size
    x, dt = x.float(), dt.float()
    # Padding steps have dt = 0: no decay and no input, so the final state is the state at L.
    xdt = _chunks(F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)), chunk_size)  # [c, l, H, P]
    B = _chunks(F.pad(B.float().repeat_interleave(repeat, 1), (0, 0, 0, 0, 0, pad)), chunk_size)
    C = _chunks(F.pad(C.float().repeat_interleave(repeat, 1), (0, 0, 0, 0, 0, pad)), chunk_size)
    log_decay = _chunks(F.pad(dt * A.float(), (0, 0, 0, pad)), chunk_size)  # [c, l, H]
    log_decay = log_decay.permute(2, 0, 1)  # [H, c, l]
    cumulative = log_decay.cumsum(-1)  # [H, c, l]

    # Within a chunk: y_l = sum_{s <= l} (C_l . B_s) exp(sum_{s < k <= l} a_k) xdt_s
    decay = torch.exp(_segment_sum(log_decay))  # [H, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)

    # Each chunk's own contribution to the state at its end, then the recurrence across chunks.
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # [H, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, to_end, xdt)  # [c, H, P, N]
    chunk_decay = torch.exp(cumulative[..., -1])  # [H, c]
    state = (
        x.new_zeros(chunk_states.shape[1:])
        if initial_state is None
        else initial_state.float().clone()
    )
    starts = []
    for chunk in range(chunk_states.shape[0]):
        starts.append(state)
        state = state * chunk_decay[:, chunk, None, None] + chunk_states[chunk]
    start_states = torch.stack(starts)  # [c, H, P, N]
    from_start = torch.exp(cumulative).permute(1, 2, 0)[..., None]  # [c, l, H, 1]
    y = y + torch.einsum("clhn,chpn->clhp", C, start_states) * from_start
    y = y.reshape(-1, *y.shape[2:])[:length] + D.float()[:, None] * x
    return y, state


def ssd_scan_with_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    state_ends: list[int],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`ssd_chunk_scan` split at `state_ends` (`split_scan`): `y` `[L, H, P]` and the states
    after each of those tokens, then the final state."""

    def scan(x, dt, B, C, state):
        return ssd_chunk_scan(x, dt, A, B, C, D, chunk_size, state)

    return split_scan(scan, (x, dt, B, C), initial_state, state_ends)


def split_scan(
    scan: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    per_token: Sequence[torch.Tensor],
    initial_state: torch.Tensor | None,
    state_ends: list[int],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A scan over one sequence, `scan(*parts of per_token, state) -> (y, state)`, run in
    parts split at `state_ends` (ascending, in `(0, L]`; `per_token` tensors are `[L, ...]`):
    the whole `y` and the states after each of those tokens, then the final state. A run that
    restarts at one of them from its state computes exactly what this one computes after it."""
    ys, states, start, state = [], [], 0, initial_state
    for end in [*state_ends, per_token[0].shape[0]]:
        if end == start:  # the last end is the sequence's own
            states.append(state)
            continue
        y, state = scan(*(tensor[start:end] for tensor in per_token), state)
        ys.append(y)
        states.append(state)
        start = end
    return torch.cat(ys), states


def selective_state_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of D sequences: `state` `[D, H, P, N]`, `x` `[D, H, P]`, `dt` `[D, H]`
    (discretised), `B`/`C` `[D, G, N]`. Returns `y` `[D, H, P]` and the new state (float32)."""
    repeat = x.shape[1] // B.shape[1]
    dt = dt.float()
    B = B.float().repeat_interleave(repeat, 1)[:, :, None, :]  # [D, H, 1, N]
    C = C.float().repeat_interleave(repeat, 1)  # [D, H, N]
    decay = torch.exp(dt * A.float())[..., None, None]  # [D, H, 1, 1]
    new_state = state.float() * decay + (dt[..., None, None] * B) * x.float()[..., None]
    y = torch.einsum("dhpn,dhn->dhp", new_state, C) + D.float()[:, None] * x.float()
    return y, new_state


def _chunks(tensor: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[L, ...] (L a multiple of chunk_size) -> [L / chunk_size, chunk_size, ...]."""
    return tensor.reshape(-1, chunk_size, *tensor.shape[1:])


def _segment_sum(log_decay: torch.Tensor) -> torch.Tensor:
    """`[..., l]` -> `[..., l, s]`: sum of log_decay over (s, l] for s <= l, -inf above.
    Summed from masked copies rather than as differences of cumulative sums, which lose
    precision when the sums grow."""
    length = log_decay.shape[-1]
    repeated = log_decay[..., None].expand(*log_decay.shape, length)  # [..., l(k), s]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=log_decay.device), -1)
    sums = repeated.masked_fill(~below, 0).cumsum(dim=-2)  # [..., l, s]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=log_decay.device))
    return sums.masked_fill(~causal, -torch.inf)
