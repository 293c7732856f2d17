"""Engine configuration: how the KV cache is sized and what one scheduler step may hold.

Both configs are frozen and checked on construction, so a bad value fails where it is set, with
the field's name and allowed range, instead of deep inside a step. How many KV blocks exist is
decided once, by the engine, from `CacheConfig` and the family's cache groups
(`cache_groups.num_blocks_for_budget`); the scheduler and the block manager only ever see the
resulting count.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_BLOCK_SIZE = 1024


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    The pool size comes from the first of: `num_blocks`, `kv_cache_memory` (bytes), or
    `memory_fraction` of the device memory left after the weights. `held_share` caps the
    fraction of the pool that held prefixes (live video sessions) may pin, so sessions can
    never starve ordinary requests.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    held_share: float = 0.5

    def __post_init__(self) -> None:
        size = self.block_size
        if not 1 <= size <= _MAX_BLOCK_SIZE or size & (size - 1):
            raise ValueError(f"block_size={size} must be a power of two in [1, {_MAX_BLOCK_SIZE}]")
        for name in ("num_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 or None")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(
                f"set at most one of num_blocks={self.num_blocks} and "
                f"kv_cache_memory={self.kv_cache_memory}"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in (0, 1]")
        if not 0.0 <= self.held_share <= 1.0:
            raise ValueError(f"held_share={self.held_share} must be in [0, 1]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduler step and of one request.

    Without chunked prefill a whole prompt must fit one step, so `max_num_batched_tokens` must
    then cover `max_model_len` (a preempted request recomputes its prompt and its output).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 32768
    max_visual_tokens_per_request: int = 16384
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_visual_tokens_per_request < 0:
            raise ValueError(
                f"max_visual_tokens_per_request={self.max_visual_tokens_per_request} must be >= 0"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when enable_chunked_prefill is False"
            )


DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an `LLMEngine` needs besides the checkpoint."""

    dtype: str = "float32"
    device: str = "cpu"
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
