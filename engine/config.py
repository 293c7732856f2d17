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

    `max_prefill_tokens_per_request` caps one request's prefill chunk (None: the whole step
    budget), so a long prompt leaves room in every step for other requests' prefill and decodes
    instead of holding them until it is done. A bidirectional item, or a block-aligned chunk,
    that does not fit the cap still runs whole when the step has room for it.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_num_held_seqs: int = 16
    max_model_len: int = 32768
    max_visual_tokens_per_request: int = 16384
    enable_chunked_prefill: bool = True
    max_prefill_tokens_per_request: int | None = None

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
        cap = self.max_prefill_tokens_per_request
        if cap is not None and not 1 <= cap <= self.max_num_batched_tokens:
            raise ValueError(
                f"max_prefill_tokens_per_request={cap} must be None or in "
                f"[1, max_num_batched_tokens={self.max_num_batched_tokens}]"
            )
        if cap is not None and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_prefill_tokens_per_request={cap} splits prompts into chunks; it needs "
                "enable_chunked_prefill=True"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when enable_chunked_prefill is False"
            )


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "int8", "w8a8")
QUANTIZATION_SKIPS = ("lm_head",)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decoding request proposes up to `num_speculative_tokens`
    tokens (K) per step, scored together in one verify step.

    `method`: "ngram" (prompt lookup over the request's own tokens, n-grams from
    `prompt_lookup_max` down to `prompt_lookup_min`), "suffix" (the same over the request and
    recent outputs of requests with its cache salt) or "draft" (a smaller checkpoint at
    `draft_model`, proposing greedily). `k_per_batch` caps K by batch size: pairs
    (min batch size, K), e.g. ((1, 4), (8, 2), (32, 0)); empty means K at every size. With
    `dynamic`, K is also lowered per request where its measured acceptance and the measured
    cost of a verify step say speculation would not pay.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    k_per_batch: tuple[tuple[int, int], ...] = ()
    dynamic: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method={self.method!r} must be one of {SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={k!r} must be an int in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(
                f"draft_model={self.draft_model!r}: a path is needed for method='draft' and "
                f"allowed only there (method={self.method!r})"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} and prompt_lookup_max="
                f"{self.prompt_lookup_max} must satisfy 1 <= min <= max"
            )
        pairs = tuple(tuple(pair) for pair in self.k_per_batch)
        object.__setattr__(self, "k_per_batch", pairs)
        sizes = [size for size, _ in pairs]
        if sizes != sorted(set(sizes)) or any(size < 1 for size in sizes):
            raise ValueError(f"k_per_batch={pairs}: batch sizes must be >= 1 and increasing")
        if any(not 0 <= k_cap <= k for _, k_cap in pairs):
            raise ValueError(f"k_per_batch={pairs}: each K must be in [0, {k}]")

    def k_for_batch(self, batch_size: int) -> int:
        """K allowed by the table at this many decoding requests."""
        k = self.num_speculative_tokens
        for size, k_cap in self.k_per_batch:
            if batch_size >= size:
                k = k_cap
        return k


def parse_k_per_batch(text: str) -> tuple[tuple[int, int], ...]:
    """`"1:4,8:2,32:0"` -> ((1, 4), (8, 2), (32, 0)); raises ValueError naming the format."""
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        size, sep, k = part.partition(":")
        if not sep or not size.strip().isdigit() or not k.strip().isdigit():
            raise ValueError(f"k_per_batch {text!r}: expected 'BATCH:K,BATCH:K', e.g. '1:4,8:2'")
        pairs.append((int(size), int(k)))
    return tuple(pairs)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an `LLMEngine` needs besides the checkpoint.

    `dtype` is the format weights are stored in ("auto": the checkpoint's own); on CPU
    activations are float32 whatever it is (decode's products widen the stored weights), on
    CUDA it is also the compute dtype. `quantization="int8"` stores every matrix as int8 with a
    scale per output channel (`engine.quantization`); "w8a8" the same, with prefill's rows
    quantized per token and summed in integers (`models.w8a8`). `quantization_skip=("lm_head",)`
    keeps the LM head (a tied embedding with it) in `dtype`. `kv_cache_dtype` is the K/V pool's
    dtype ("auto": float32 on CPU, the model's dtype on CUDA); bfloat16 halves its bytes per
    block. `compute_dtype` is the arithmetic of prefill batches and the vision tower
    (`engine.arithmetic`; "auto": bfloat16 for bfloat16 weights on a CPU with bfloat16 dot
    products, else float32); decode's native CPU step keeps its own. On CUDA, decode steps
    replay one CUDA graph per batch bucket (`engine.cuda_graphs`), captured at start;
    `enforce_eager` runs every step eagerly instead (no capture time, no graph memory, slower
    small-batch decodes). Ignored on CPU.
    """

    dtype: str = "auto"
    device: str = "cpu"
    enforce_eager: bool = False
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    quantization: str | None = None
    quantization_skip: tuple[str, ...] = ()
    kv_cache_dtype: str = "auto"
    compute_dtype: str = "auto"
    speculative: SpeculativeConfig | None = None

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
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype={self.compute_dtype!r} must be one of {COMPUTE_DTYPES}"
            )
        if self.quantization is not None and not self.device.startswith("cpu"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on CPU only (device={self.device!r}); "
                "on CUDA use dtype='bfloat16' or 'float16' without quantization"
            )
