"""Start-up measurement of what a verify step costs on this machine.

For batch sizes 1, 2, 4, ... up to the seats, and K = 0..K_max drafts per request, the model
runs one step of that many requests, each at a short context with 1 + K query tokens, logits
for every query token included, on the engine's own (still empty) K/V cache; the median of a
few runs is kept. `step_cost(batch, k)` is then t(batch, k) / t(batch, 0) at the largest
measured batch size not above `batch` (the next measured one would overstate the cost).
Nothing is left behind: the blocks written are free and unhashed, and any later request
writes its own slots before reading them.
"""

from __future__ import annotations

import bisect
import statistics
import time

import torch

from stillcut.kernels.attention import AttentionMetadata

CONTEXT_TOKENS = 64  # context each calibration request attends to
NUM_RUNS = 3


def measure_step_costs(runner, max_batch: int, max_k: int) -> dict[int, list[float]]:
    """Batch size -> [t(b, k) / t(b, 0) for k in 0..max_k] (see the module docstring)."""
    block_size = runner.block_size
    num_blocks = runner.kv_caches[0].shape[1] if runner.kv_caches else 1
    blocks_per_request = -(-(CONTEXT_TOKENS + max_k + 1) // block_size)
    costs: dict[int, list[float]] = {}
    batch = 1
    while batch <= max_batch and batch * blocks_per_request <= num_blocks:
        if batch * (1 + max_k) > runner.max_num_batched_tokens:
            break
        times = [_time_step(runner, batch, 1 + k, blocks_per_request) for k in range(max_k + 1)]
        costs[batch] = [t / times[0] for t in times]
        batch *= 2
    return costs or {1: [1.0 + k for k in range(max_k + 1)]}


class StepCosts:
    """`step_cost(batch, k)` from measured costs (see the module docstring)."""

    def __init__(self, costs: dict[int, list[float]]) -> None:
        self.sizes = sorted(costs)
        self.costs = costs

    def __call__(self, batch: int, k: int) -> float:
        size = self.sizes[max(bisect.bisect_right(self.sizes, batch) - 1, 0)]
        return self.costs[size][k]


def _time_step(runner, batch: int, width: int, blocks_per_request: int) -> float:
    """Median seconds of a model step (forward + logits) of `batch` requests x `width` tokens."""
    device, size = runner.device, runner.block_size
    seq_len = CONTEXT_TOKENS + width
    num_tokens = batch * width
    block_tables = torch.arange(batch * blocks_per_request, dtype=torch.int32).view(batch, -1)
    token_pos = torch.arange(CONTEXT_TOKENS, seq_len)  # [width]
    slots = block_tables[:, token_pos // size].long() * size + token_pos % size  # [batch, width]
    starts = list(range(0, num_tokens + 1, width))
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=slots.flatten().to(device),
        max_query_len=width,
        max_seq_len=seq_len,
        query_start_loc_cpu=starts,
        seq_lens_cpu=[seq_len] * batch,
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = token_pos.repeat(batch).expand(runner.model.num_position_rows, -1).to(device)
    times = []
    with torch.inference_mode():
        for _ in range(NUM_RUNS + 1):  # the first run warms up
            metadata.plans.clear()
            start = time.perf_counter()
            hidden = runner.model(input_ids, positions, runner.kv_caches, metadata)
            runner.model.compute_logits(hidden)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
