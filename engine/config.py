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
DEFAULT_SNAPSHOT_INTERVAL = 8


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    The pool size comes from the first of: `num_blocks`, `kv_cache_memory` (bytes), or
    `memory_fraction` of the device memory left after the weights. `held_share` caps the
    fraction of the pool that held prefixes (live video sessions) may pin, so sessions can
    never starve ordinary requests.

    For a model with recurrent layers, every `mamba_snapshot_interval`-th full block of a
    prefill saves a snapshot of their state (besides the ends of prompts and items, see
    `state_snapshots`); the budget holds one snapshot per that many blocks, or
    `num_state_snapshots` when set.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    held_share: float = 0.5
    mamba_snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL
    num_state_snapshots: int | None = None

    def __post_init__(self) -> None:
        size = self.block_size
        if not 1 <= size <= _MAX_BLOCK_SIZE or size & (size - 1):
            raise ValueError(f"block_size={size} must be a power of two in [1, {_MAX_BLOCK_SIZE}]")
        if self.mamba_snapshot_interval < 1:
            raise ValueError(
                f"mamba_snapshot_interval={self.mamba_snapshot_interval} must be >= 1 (blocks)"
            )
        for name in ("num_blocks", "kv_cache_memory", "num_state_snapshots"):
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
    """Limits of one scheduler step and of one request. `max_num_held_seqs` live requests
    (held prefixes, streaming requests) may exist besides the `max_num_seqs` running ones.

    Without chunked prefill a whole prompt must fit one step, so `max_num_batched_tokens` must
    then cover `max_model_len` (a preempted request recomputes its prompt and its output).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_num_held_seqs: int = 16
    max_model_len: int = 32768
    max_visual_tokens_per_request: int = 16384
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_num_held_seqs < 0:
            raise ValueError(f"max_num_held_seqs={self.max_num_held_seqs} must be >= 0")
        if self.max_visual_tokens_per_request < 0:
            raise ValueError(
                f"max_visual_tokens_per_request={self.max_visual_tokens_per_request} must be >= 0"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when enable_chunked_prefill is False"
            )


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "int8")
QUANTIZATION_SKIPS = ("lm_head",)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an `LLMEngine` needs besides the checkpoint.

    `dtype` is the format weights are stored in ("auto": the checkpoint's own); on CPU
    activations and sums are float32 whatever it is (products widen the stored weights), on
    CUDA it is also the compute dtype. `quantization="int8"` stores every matrix as int8 with a
    scale per output channel (`engine.quantization`); `quantization_skip=("lm_head",)` keeps
    the LM head (a tied embedding with it) in `dtype`. `kv_cache_dtype` is the K/V pool's
    dtype ("auto": float32 on CPU, the model's dtype on CUDA); bfloat16 halves its bytes per
    block. On CUDA, decode steps replay one CUDA graph per batch bucket (`engine.cuda_graphs`),
    captured at start; `enforce_eager` runs every step eagerly instead (no capture time, no
    graph memory, slower small-batch decodes). Ignored on CPU.
    """

    dtype: str = "auto"
    device: str = "cpu"
    enforce_eager: bool = False
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    quantization: str | None = None
    quantization_skip: tuple[str, ...] = ()
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} must be one of {QUANTIZATIONS}")
        unknown = [name for name in self.quantization_skip if name not in QUANTIZATION_SKIPS]
        if unknown:
            raise ValueError(
                f"quantization_skip={self.quantization_skip!r}: {unknown} unknown; allowed "
                f"{QUANTIZATION_SKIPS}"
            )
        if self.quantization_skip and self.quantization is None:
            raise ValueError(
                f"quantization_skip={self.quantization_skip!r} needs a quantization; "
                f"allowed: {QUANTIZATIONS[1:]}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {KV_CACHE_DTYPES}"
            )
        if self.quantization is not None and not self.device.startswith("cpu"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on CPU only (device={self.device!r}); "
                "on CUDA use dtype='bfloat16' or 'float16' without quantization"
            )
