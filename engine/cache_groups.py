"""Cache groups: what each layer of a language model keeps between steps, and how many fit.

Attention layers keep keys and values in paged blocks shared by every request through block
tables; recurrent layers (Mamba2 conv and SSM state) keep one fixed-size state per running
request. A model family lists its layers as groups (DESIGN.md, "Cache groups"): an
`AttentionGroup` per distinct K/V shape or window, a `RecurrentGroup` per distinct state shape.
The KV pool is sized from the groups once, and the runner allocates one tensor per layer from
them: a layer's K/V `[2, num_blocks, block_size, num_kv_heads, head_dim]`, a layer's recurrent
state `[num_state_slots, *shape]` per state tensor. Snapshots of recurrent states (hybrid
prefix caching, `state_snapshots`) are sized like a request's state and come out of the same
budget: one per `snapshot_interval` KV blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionGroup:
    """Layers whose K/V live in paged blocks: their ids (in model order), heads and head size;
    `sliding_window` (None: every key) is how far back they attend, in sequence slots."""

    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _check_layer_ids(self.layer_ids)
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 or None")

    def layer_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's K/V: [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """K and V of `block_size` tokens in every layer of the group."""
        per_token = 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        return len(self.layer_ids) * block_size * per_token


@dataclass(frozen=True)
class RecurrentGroup:
    """Layers that carry a recurrent state per request: their ids and, per layer, the shapes of
    its state tensors (e.g. a Mamba2 layer's conv state and SSM state), kept in `dtype` (None:
    the dtype the model computes in). `prompt_dependent` says the layers compute a prompt
    token otherwise than a generated one (Mamba2 floors dt for prompt tokens only): a
    request's generated tokens then leave another state than a fresh prompt holding them
    would, so its input cannot be streamed (`LLMEngine.add_request`)."""

    layer_ids: tuple[int, ...]
    state_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype | None = None
    prompt_dependent: bool = False

    def __post_init__(self) -> None:
        _check_layer_ids(self.layer_ids)
        if not self.state_shapes or any(not shape or min(shape) < 1 for shape in self.state_shapes):
            raise ValueError(f"state_shapes={self.state_shapes} must be non-empty positive shapes")

    def bytes_per_request(self, dtype_bytes: int) -> int:
        """One request's state in every layer of the group, `dtype_bytes` per value unless the
        group has a `dtype` of its own."""
        per_layer = sum(math.prod(shape) for shape in self.state_shapes)
        value_bytes = dtype_bytes if self.dtype is None else self.dtype.itemsize
        return len(self.layer_ids) * per_layer * value_bytes


CacheGroup = AttentionGroup | RecurrentGroup


def attention_groups(groups: Sequence[CacheGroup]) -> list[AttentionGroup]:
    return [group for group in groups if isinstance(group, AttentionGroup)]


def recurrent_groups(groups: Sequence[CacheGroup]) -> list[RecurrentGroup]:
    return [group for group in groups if isinstance(group, RecurrentGroup)]


def check_cache_groups(groups: Sequence[CacheGroup], num_layers: int) -> None:
    """Every layer in [0, num_layers) belongs to at most one group, and some group pages K/V
    (the scheduler's block tables are the only way requests get room)."""
    seen = [layer for group in groups for layer in group.layer_ids]
    if len(seen) != len(set(seen)) or any(not 0 <= layer < num_layers for layer in seen):
        raise ValueError(
            f"cache groups cover layers {sorted(seen)}: each of the {num_layers} layers "
            "belongs to at most one group"
        )
    if not attention_groups(groups):
        raise ValueError("a model needs at least one attention cache group")


def kv_bytes_per_block(groups: Sequence[CacheGroup], block_size: int, dtype_bytes: int) -> int:
    """Bytes one KV block takes across every attention layer."""
    return sum(g.bytes_per_block(block_size, dtype_bytes) for g in attention_groups(groups))


def state_bytes_per_request(groups: Sequence[CacheGroup], dtype_bytes: int) -> int:
    """Bytes one request's recurrent state takes across every recurrent layer (0 for none);
    `dtype_bytes` per value of the groups without a `dtype` of their own."""
    return sum(g.bytes_per_request(dtype_bytes) for g in recurrent_groups(groups))


def num_snapshots_for_budget(
    budget_bytes: int,
    groups: Sequence[CacheGroup],
    *,
    block_size: int,
    dtype_bytes: int,
    num_state_slots: int,
    snapshot_interval: int,
    state_dtype_bytes: int | None = None,
) -> int:
    """How many recurrent-state snapshots to keep: one per `snapshot_interval` KV blocks of
    what `budget_bytes` holds after `num_state_slots` states, at least one; 0 for a model
    without recurrent layers. `state_dtype_bytes` as in `num_blocks_for_budget`."""
    state_bytes = state_bytes_per_request(groups, state_dtype_bytes or dtype_bytes)
    if not state_bytes:
        return 0
    block_bytes = kv_bytes_per_block(groups, block_size, dtype_bytes)
    remaining = max(budget_bytes - num_state_slots * state_bytes, 0)
    return max(1, remaining // (snapshot_interval * block_bytes + state_bytes))


def num_blocks_for_budget(
    budget_bytes: int,
    groups: Sequence[CacheGroup],
    *,
    block_size: int,
    dtype_bytes: int,
    num_state_slots: int = 0,
    state_dtype_bytes: int | None = None,
) -> int:
    """How many KV blocks fit in `budget_bytes` once `num_state_slots` recurrent states (one per
    request that can run at once, plus the snapshots; `state_dtype_bytes` per value, by default
    the K/V's `dtype_bytes`) have taken their share."""
    if block_size < 1 or dtype_bytes < 1:
        raise ValueError(f"block_size={block_size} and dtype_bytes={dtype_bytes} must be >= 1")
    state_bytes = num_state_slots * state_bytes_per_request(
        groups, state_dtype_bytes or dtype_bytes
    )
    block_bytes = kv_bytes_per_block(groups, block_size, dtype_bytes)
    num_blocks = max(budget_bytes - state_bytes, 0) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"budget_bytes={budget_bytes} holds no KV block: one block needs {block_bytes} "
            f"bytes after {state_bytes} bytes of recurrent state in {num_state_slots} slots"
        )
    return num_blocks


def _check_layer_ids(layer_ids: tuple[int, ...]) -> None:
    if not layer_ids or list(layer_ids) != sorted(set(layer_ids)) or layer_ids[0] < 0:
        raise ValueError(f"layer_ids={layer_ids} must be distinct, ascending and >= 0")
