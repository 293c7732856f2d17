"""Start-up measurement of what a verify step costs on this machine.

At batch sizes 1, 4, 16, ... up to the seats, the model runs one step of that many requests at
a short context with 1, 2, ..., 1 + K_max query tokens each, logits for every query token
included, on the engine's own (still empty) K/V cache, and the step's tokens are sampled as a
verify step samples them (greedy, every draft accepted: each position in turn, the most a
verify step samples); the median of a few runs is kept, and
`step_cost(batch, k)` is the time with k drafts per request over the time with none, at the
largest measured batch size not above `batch`. Each k is measured, not interpolated: the cost
is not linear in k (past 16 rows a step leaves the native decode step, and a large vocabulary
makes every row's logits costly), and a guess that is too low makes speculation slower than
none. With a draft model, proposing k tokens costs about k of its decode steps at that batch
size, measured the same way and added. The widths are measured in interleaved rounds (plain,
k = 1, ..., K, then again), each k's cost the median of its rounds' ratios to the round's plain
step, so that a machine whose speed drifts during start-up skews no k against another; and a
cost is never below the one of fewer drafts (a verify step of k drafts does all the work of
one of k - 1, so a lower reading is noise: measured on a shared 2-core CPU, single readings put
k = 1 at 0.90 of a plain step, and a request whose drafts were never accepted then went on
speculating at 0.89x the tokens/s of none). Nothing is left behind: the blocks written are free
and unhashed, and any later request writes its own slots before reading them (a recurrent
model's state rows too: a request's state starts from zeros or a snapshot).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
import time

import torch

from stillcut.engine.request import SamplingParams
from stillcut.engine.row_sampler import RowSampler
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.mamba2 import RecurrentMetadata

CONTEXT_TOKENS = 64  # context each calibration request attends to
NUM_RUNS = 3  # timed runs of a step, after one to warm up: the median counts
NUM_ROUNDS = 3  # interleaved rounds of the calibration, one timed run per width each


def measure_step_costs(runner, max_batch: int, max_k: int, draft_runner=None) -> StepCosts:
    """The measured `StepCosts` of `runner` (and of proposing with `draft_runner`, if any)."""
    block_size = runner.block_size
    num_blocks = runner.kv_caches[0].shape[1] if runner.kv_caches else 1
    blocks_per_request = -(-(CONTEXT_TOKENS + max_k + 1) // block_size)
    costs: dict[int, tuple[float, ...]] = {}
    batch = 1
    while batch <= max_batch and batch * blocks_per_request <= num_blocks:
        if batch * (1 + max_k) > runner.max_num_batched_tokens:
            break
        ratios: list[list[float]] = [[] for _ in range(max_k)]
        for _ in range(NUM_ROUNDS):
            plain = time_verify_step(runner, batch, 1, blocks_per_request, runs=1)
            draft = 0.0
            if draft_runner is not None:
                draft = time_verify_step(draft_runner, batch, 1, blocks_per_request, runs=1)
            for k in range(1, max_k + 1):
                step = time_verify_step(runner, batch, 1 + k, blocks_per_request, runs=1)
                ratios[k - 1].append((step + k * draft) / plain)
        costs[batch] = tuple(itertools.accumulate([1.0, *map(statistics.median, ratios)], max))
        batch *= 4
    return StepCosts(costs or {1: tuple(1.0 + k for k in range(max_k + 1))})


class StepCosts:
    """`step_cost(batch, k)`: batch size -> the cost with k = 0, 1, ... drafts per request
    (see the module docstring)."""

    def __init__(self, costs: dict[int, tuple[float, ...]]) -> None:
        self.sizes = sorted(costs)
        self.costs = costs

    def __call__(self, batch: int, k: int) -> float:
        size = self.sizes[max(bisect.bisect_right(self.sizes, batch) - 1, 0)]
        return self.costs[size][k]


def time_verify_step(
    runner,
    batch: int,
    width: int,
    blocks_per_request: int,
    sampled: bool = True,
    runs: int = NUM_RUNS,
) -> float:
    """Median seconds of `runs` model steps (forward, logits and sampling) of `batch` requests
    x `width` tokens, laid out as the runner lays out a verify step: one one-token row per
    token; without `sampled`, forward and logits only."""
    device, size = runner.device, runner.block_size
    num_tokens = batch * width
    block_tables = torch.arange(batch * blocks_per_request, dtype=torch.int32).view(batch, -1)
    token_pos = torch.arange(CONTEXT_TOKENS, CONTEXT_TOKENS + width)  # [width]
    slots = block_tables[:, token_pos // size].long() * size + token_pos % size  # [batch, width]
    seq_lens = (token_pos + 1).repeat(batch).tolist()  # [num_tokens]
    starts = list(range(num_tokens + 1))
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.repeat_interleave(width, dim=0).to(device),
        slot_mapping=slots.flatten().to(device),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    metadata.recurrent = _recurrent_metadata(runner, batch, width)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = token_pos.repeat(batch).expand(runner.model.num_position_rows, -1).to(device)
    request_ids = [f"calibration-{r}" for r in range(batch)]
    params = [SamplingParams()] * batch

    def forward() -> torch.Tensor:
        hidden = runner.model(input_ids, positions, runner.kv_caches, metadata)
        return runner.model.compute_logits(hidden)

    sampler = RowSampler(device, keyed_draws=True)
    with torch.inference_mode():
        metadata.plans.clear()  # a warm-up, and drafts its greedy tokens accept
        logits = forward()
        drafts = logits.argmax(dim=-1).view(batch, width)[:, :-1].tolist()
        sampler.sample(request_ids, params, _no_history, logits, drafts, [0] * batch)
        times = []
        for _ in range(runs):
            metadata.plans.clear()
            start = time.perf_counter()
            logits = forward()
            if sampled:
                sampler.sample(request_ids, params, _no_history, logits, drafts, [0] * batch)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _recurrent_metadata(runner, batch: int, width: int) -> RecurrentMetadata | None:
    """A model with recurrent layers: `batch` requests in state rows 0, 1, ..., each
    verifying `width - 1` drafts (none: a decode)."""
    if not runner.recurrent_states:
        return None
    return RecurrentMetadata(
        states=runner.recurrent_states,
        state_rows_cpu=list(range(batch)),
        fresh=[False] * batch,
        query_start_loc_cpu=list(range(0, batch * width + 1, width)),
        prompt_token_mask=torch.zeros(batch * width, dtype=torch.bool, device=runner.device),
        verifying=[width > 1] * batch,
        draft_states=runner.draft_states,
        draft_stride=runner.recurrent.draft_stride,
    )


def _no_history(index: int):
    raise AssertionError("greedy rows without penalties read no history")
