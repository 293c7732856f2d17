"""How the engine splits its memory: K/V blocks, recurrent-state snapshots, decode buckets.

The K/V budget is `CacheConfig.kv_cache_memory`, else `memory_fraction` of the memory free now.
A draft model's pool has as many blocks as ours, so with one our share of the budget is in
proportion to our bytes per block. Recurrent states (one per runner row) and their snapshots
come out of the same budget before the K/V blocks; blocks never exceed what every seat filled
to `max_model_len` could use. Decode steps are padded to buckets and replayed as CUDA graphs
where graphs are available (`cuda_graphs`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stillcut.engine.arithmetic import Arithmetic
from stillcut.engine.cache_groups import (
    CacheGroup,
    kv_bytes_per_block,
    num_blocks_for_budget,
    num_snapshots_for_budget,
    recurrent_groups,
    state_bytes_per_request,
)
from stillcut.engine.config import EngineConfig
from stillcut.engine.cuda_graphs import decode_buckets, graphs_unavailable
from stillcut.engine.spec_decode.draft import draft_block_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine allocates: `num_blocks` K/V blocks and `num_snapshots` recurrent-state
    snapshot slots, in `kv_dtype` / `state_dtype`; decode steps padded to `decode_buckets`
    (empty: run eagerly, for the reason in `no_graphs`); each scheduled request scores at
    most `1 + max_spec_tokens` positions."""

    num_blocks: int
    num_snapshots: int
    kv_dtype: torch.dtype
    state_dtype: torch.dtype
    decode_buckets: tuple[int, ...]
    no_graphs: str | None
    max_spec_tokens: int


@dataclass(frozen=True)
class EngineMemory:
    """What the engine holds: the weights' stored format and bytes (the language model's; int8
    scales included), the K/V pool's dtype, bytes and blocks."""

    weight_format: str
    weight_bytes: int
    kv_cache_dtype: str
    kv_cache_bytes: int
    kv_blocks: int
    arithmetic: Arithmetic

    def __str__(self) -> str:
        return (
            f"language model weights: {self.weight_format}, {self.weight_bytes / 2**20:.1f} MiB; "
            f"prefill and tower arithmetic: {self.arithmetic.name} ({self.arithmetic.reason}); "
            f"KV pool: {self.kv_cache_dtype}, {self.kv_blocks} blocks, "
            f"{self.kv_cache_bytes / 2**20:.1f} MiB"
        )


def plan_memory(
    config: EngineConfig,
    cache_groups: Sequence[CacheGroup],
    kv_dtype: torch.dtype,
    state_dtype: torch.dtype,
    num_rows: int,
) -> MemoryPlan:
    """The plan for a model of `cache_groups` whose runner keeps `num_rows` request rows."""
    budget = config.cache.kv_cache_memory or int(config.cache.memory_fraction * _free(config))
    budget = _target_budget(config, cache_groups, budget, kv_dtype)
    sizes = _Sizes(config, cache_groups, budget, kv_dtype, state_dtype)
    num_snapshots = sizes.num_state_snapshots(num_rows)
    num_blocks = sizes.num_blocks(num_rows + num_snapshots)
    no_graphs = graphs_unavailable(
        torch.device(config.device), bool(recurrent_groups(cache_groups))
    )
    if config.enforce_eager:
        no_graphs = "enforce_eager is set"
    # a step decodes at most max_num_seqs running requests (rows may hold more, waiting),
    # each 1 + K one-token rows when it verifies drafts
    max_spec_tokens = config.speculative.num_speculative_tokens if config.speculative else 0
    max_decodes = min(config.scheduler.max_num_seqs, num_rows) * (1 + max_spec_tokens)
    buckets = (
        () if no_graphs else decode_buckets(max_decodes, config.scheduler.max_num_batched_tokens)
    )
    return MemoryPlan(
        num_blocks, num_snapshots, kv_dtype, state_dtype, buckets, no_graphs, max_spec_tokens
    )


def _target_budget(
    config: EngineConfig, groups: Sequence[CacheGroup], budget: int, kv_dtype: torch.dtype
) -> int:
    """Our share of the K/V budget: all of it, or with a draft model (whose pool has as
    many blocks as ours) the part in proportion to our block bytes."""
    if config.speculative is None:
        return budget
    block_size = config.cache.block_size
    ours = kv_bytes_per_block(groups, block_size, kv_dtype.itemsize)
    theirs = draft_block_bytes(config.speculative, block_size, kv_dtype.itemsize)
    return budget * ours // (ours + theirs)


@dataclass(frozen=True)
class _Sizes:
    config: EngineConfig
    groups: Sequence[CacheGroup]
    budget: int
    kv_dtype: torch.dtype
    state_dtype: torch.dtype

    def num_blocks(self, num_state_slots: int) -> int:
        """KV blocks for the budget, after the recurrent states (one per runner row) and their
        snapshots, if any."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_blocks is not None:
            return cache.num_blocks
        # never more than every seat filled to max_model_len could use
        needed = 2 * sched.max_num_seqs * -(-sched.max_model_len // cache.block_size)
        fitting = num_blocks_for_budget(
            self.budget,
            self.groups,
            block_size=cache.block_size,
            dtype_bytes=self.kv_dtype.itemsize,
            state_dtype_bytes=self.state_dtype.itemsize,
            num_state_slots=num_state_slots,
        )
        return min(fitting, needed)

    def num_state_snapshots(self, num_rows: int) -> int:
        """Recurrent-state snapshot slots (0 without recurrent layers): as configured, one per
        `mamba_snapshot_interval` configured blocks, or their share of the budget."""
        cache = self.config.cache
        if not state_bytes_per_request(self.groups, self.state_dtype.itemsize):
            return 0
        if cache.num_state_snapshots is not None:
            return cache.num_state_snapshots
        if cache.num_blocks is not None:
            return max(1, cache.num_blocks // cache.mamba_snapshot_interval)
        return num_snapshots_for_budget(
            self.budget,
            self.groups,
            block_size=cache.block_size,
            dtype_bytes=self.kv_dtype.itemsize,
            state_dtype_bytes=self.state_dtype.itemsize,
            num_state_slots=num_rows,
            snapshot_interval=cache.mamba_snapshot_interval,
        )


def _free(config: EngineConfig) -> int:
    if config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
