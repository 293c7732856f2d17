"""A recurrent layer of the conv-then-scan kind over the runner's flat batch: the bookkeeping.

Mamba2 and Gated DeltaNet layers both keep two states per request: the last inputs of a
depthwise causal conv, and the state of a scan over the conv's output (an SSM state, a
delta-rule matrix). Per step, every decoding request advances both by one token in one batched
call, a request verifying speculative drafts advances them token by token keeping each
position's states for the runner's rollback (`conv_scan_steps`), and each prompt chunk runs the
conv and the layer's chunked scan on its own (`conv_scan_chunk`), split where the step saves
snapshots of the states (`RecurrentMetadata.captures`). This module reads and writes the
runner's state rows, draft slots and snapshot slots; the layer gives the scan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stillcut.kernels.mamba2 import (
    RecurrentMetadata,
    causal_conv1d,
    causal_conv1d_step,
    conv_state_after,
)

# (tokens of the batch, their conv output, the scan states of their rows) -> (y, new states)
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (a request's tokens, their conv output, its scan state or None, ends to save states at)
# -> (y, the states after each end, then the final state)
Scan = Callable[
    [slice, torch.Tensor, torch.Tensor | None, list[int]],
    tuple[torch.Tensor, list[torch.Tensor]],
]


def conv_scan_steps(
    recurrent: RecurrentMetadata,
    layer_id: int,
    conv_in: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    step: Step,
    out: torch.Tensor,
) -> None:
    """Every request that advances its stored states a token at a time: the decodes
    (`recurrent.one_token_steps`) in one batched call, then the requests verifying drafts
    position by position (`recurrent.verify_positions`), each position's states also kept in
    its draft slots. A token's conv takes its `conv_in` row (`[N, conv_dim]`, the whole
    batch's) after the stored inputs, then `step`; its `y` goes to its row of `out`. Saves the
    states the step's captures ask for."""
    tokens, rows, _ = recurrent.one_token_steps
    if tokens.numel():
        states = _advance(recurrent, layer_id, tokens, rows, conv_in, conv_weight, conv_bias,
                          step, out)  # fmt: skip
        _save(recurrent.snapshots, layer_id, states, recurrent.one_token_captures)
    for position in recurrent.verify_positions:
        states = _advance(
            recurrent, layer_id, position.tokens, position.rows, conv_in, conv_weight,
            conv_bias, step, out,
        )  # fmt: skip
        for drafts, state in zip(recurrent.draft_states[layer_id], states, strict=True):
            drafts[position.draft_slots] = state.to(drafts.dtype)
        _save(recurrent.snapshots, layer_id, states, position.captures)


def _advance(recurrent, layer_id, tokens, rows, conv_in, conv_weight, conv_bias, step, out):
    """One token each for state rows `rows`: their new conv and scan states (also stored)."""
    conv_states, scan_states = recurrent.states[layer_id]
    conv_out, new_conv = causal_conv1d_step(
        conv_in[tokens], conv_states[rows], conv_weight, conv_bias
    )
    conv_states[rows] = new_conv.to(conv_states.dtype)
    y, new_state = step(tokens, conv_out, scan_states[rows])
    scan_states[rows] = new_state.to(scan_states.dtype)
    out[tokens] = y.to(out.dtype)
    return new_conv, new_state


def _save(snapshots, layer_id: int, states, captures) -> None:
    """States `[n, *shape]` each into the snapshot slots `captures` (indices into them, and
    slots) names; nothing when None."""
    if captures is not None:
        index, slots = captures
        for saved, state in zip(snapshots[layer_id], states, strict=True):
            saved[slots] = state[index].to(saved.dtype)


def conv_scan_chunk(
    recurrent: RecurrentMetadata,
    layer_id: int,
    request: int,
    conv_in: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    scan: Scan,
) -> tuple[slice, torch.Tensor]:
    """Request `request`'s tokens (a prompt chunk, or a fresh request's tokens): the conv of
    their `conv_in` rows after its stored inputs (zeros when fresh), then `scan` from its
    stored state, split at its captures. Stores the new states, saves the captured ones,
    returns its tokens and `y`."""
    starts = recurrent.query_start_loc_cpu
    tokens = slice(starts[request], starts[request + 1])
    row, fresh = recurrent.state_rows_cpu[request], recurrent.fresh[request]
    conv_states, scan_states = recurrent.states[layer_id]
    conv_state = None if fresh else conv_states[row].clone()  # the row is rewritten below
    inputs = conv_in[tokens]
    conv_out, new_conv = causal_conv1d(inputs, conv_state, conv_weight, conv_bias)
    conv_states[row] = new_conv.to(conv_states.dtype)
    captures = recurrent.captures[request] if recurrent.captures else []
    ends = [num_tokens for num_tokens, _ in captures]
    y, states = scan(tokens, conv_out, None if fresh else scan_states[row], ends)
    scan_states[row] = states[-1].to(scan_states.dtype)
    num_taps = conv_weight.shape[1]
    for (num_tokens, slot), state in zip(captures, states, strict=False):
        conv_snapshot = conv_state_after(conv_state, inputs, num_tokens, num_taps)
        for snapshots, saved in zip(
            recurrent.snapshots[layer_id], (conv_snapshot, state), strict=True
        ):
            snapshots[slot] = saved.to(snapshots.dtype)
    return tokens, y
