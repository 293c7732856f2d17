"""Decode steps of a Qwen2 decoder stack on CPU in one native call (`cpu_decode.c`).

A batch-1 decode step is bound by reading the weights, but op by op in torch each of a layer's
~40 small ops also costs a fixed few microseconds, and every parallel op wakes the thread pool
again; on the 2-core CPU that overhead was larger than the layers' own weight reads. The C
kernel runs every layer of a step inside one OpenMP parallel region (the threads meet at
barriers), reading each weight once in contiguous per-thread bands.

The C file is compiled on first use with the system C compiler (`$CC`, else `cc`) into the
stillcut cache, keyed by the source, the compiler and the CPU; it links the OpenMP runtime
torch has already loaded, so both share one thread pool. Without a compiler, or with
`STILLCUT_NATIVE_DECODE=0`, `load()` returns None and the model runs its torch ops instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from stillcut.engine.disk_cache import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
MAX_ROWS = 16  # past this many rows a step is a gemm, torch's own territory
MAX_BLOCK_SIZE = 256  # `MAX_BLOCK` in the C file
ENABLE_VARIABLE = "STILLCUT_NATIVE_DECODE"


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in (
            "input_norm", "qkv_weight", "qkv_bias", "o_weight", "post_norm", "gate_up_weight",
            "down_weight", "kv_cache",
        )),
        *((name, ctypes.c_int32) for name in (
            "qkv_out_in", "o_out_in", "gate_up_out_in", "down_out_in",
        )),
    ]  # fmt: skip


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int32) for name in (
            "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "num_blocks",
            "block_size", "block_table_stride",
        )),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]  # fmt: skip


def enabled() -> bool:
    """False when `STILLCUT_NATIVE_DECODE` is set to 0 (the torch ops then run instead)."""
    return os.environ.get(ENABLE_VARIABLE, "1") != "0"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built once per source, compiler and CPU; None (logged
    once) when it cannot be built here."""
    if not enabled():
        return None
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True
        ).stdout
        key = hashlib.sha256(
            "\0".join((SOURCE.read_text(), compiler, version, *FLAGS, _cpu())).encode()
        ).hexdigest()[:16]
        target = cache_dir() / "native" / f"cpu_decode-{key}.so"
        if not target.exists():
            _compile(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("native CPU decode unavailable, using torch ops: %s", detail)
        return None
    library.decode_layers.restype = ctypes.c_int
    return library


def _compile(compiler: str, target: Path) -> None:
    """Compile into a private file beside `target`, then rename: readers never see half a
    library, and two processes compiling at once both end with a whole one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _cpu() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in info if line.startswith(wanted)}))


def _out_in(weight: torch.Tensor) -> int:
    """1 when `weight` `[in, out]` is the view of a contiguous `[out, in]`, 0 when it is a
    contiguous `[in, out]` itself."""
    if weight.is_contiguous():
        return 0
    if weight.T.is_contiguous():
        return 1
    raise ValueError(f"weight of shape {tuple(weight.shape)} is in neither layout")


class Qwen2CpuDecoder:
    """The decoder layers of a Qwen2 model (`engine.models.qwen2`) bound to the C kernel.

    `layers` are the model's decoder layers (fused `[in, out]` weights, float32, CPU); they must
    outlive this object, which keeps only their addresses."""

    def __init__(self, library: ctypes.CDLL, layers: Sequence[torch.nn.Module], eps: float):
        self.library = library
        first = layers[0]
        self.hidden = first.input_layernorm.shape[0]
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim = first.o_weight.shape[0] // self.num_heads
        self.intermediate = first.down_weight.shape[0]
        self.eps, self.scale = eps, first.scale
        self.layers = (_Layer * len(layers))()
        for slot, layer in zip(self.layers, layers, strict=True):
            for name in ("qkv_weight", "qkv_bias", "o_weight", "gate_up_weight", "down_weight"):
                tensor = getattr(layer, name)
                if tensor.dtype != torch.float32 or not tensor.is_cpu:
                    raise ValueError(f"{name} must be a float32 CPU tensor, got {tensor.dtype}")
                setattr(slot, name, tensor.data_ptr())
                if name != "qkv_bias":
                    setattr(slot, name.replace("weight", "out_in"), _out_in(tensor))
            slot.input_norm = layer.input_layernorm.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.data_ptr()
        self.kv_caches: tuple[int, ...] = ()
        self.scratch = torch.empty(0)

    def supports(self, hidden: torch.Tensor, kv_caches: Sequence[torch.Tensor], metadata) -> bool:
        """Whether this step can run here: float32 CPU rows, each the single new token of its
        own request (a step of decodes only), no more than `MAX_ROWS`, a plain KV cache."""
        rows = hidden.shape[0]
        return (
            hidden.dtype == torch.float32
            and hidden.is_cpu
            and 0 < rows <= MAX_ROWS
            and metadata.max_query_len == 1
            and metadata.seq_lens.shape[0] == rows
            and metadata.mm_ranges is None
            and kv_caches[0].dtype == torch.float32
            and kv_caches[0].shape[2] <= MAX_BLOCK_SIZE
            and all(cache.is_contiguous() for cache in kv_caches)
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        metadata,
    ) -> torch.Tensor:
        """Run every decoder layer on `hidden` [rows, hidden] (the residual stream, updated in
        place and returned) with rotary tables `cos`/`sin` [rows, 1, head_dim]."""
        rows = hidden.shape[0]
        hidden = hidden.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        addresses = tuple(cache.data_ptr() for cache in kv_caches)
        if addresses != self.kv_caches:
            for slot, address in zip(self.layers, addresses, strict=True):
                slot.kv_cache = address
            self.kv_caches = addresses
        threads = torch.get_num_threads()
        needed = rows * (
            self.hidden
            + self.qkv_width
            + self.num_heads * self.head_dim
            + 2 * self.intermediate
            + threads * max(self.qkv_width, self.hidden, 2 * self.intermediate)
        )
        if self.scratch.numel() < needed:
            self.scratch = torch.empty(needed)
        block_tables = metadata.block_tables
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        seq_lens = metadata.seq_lens.contiguous()
        slot_mapping = metadata.slot_mapping.contiguous()
        cache = kv_caches[0]
        shape = _Shape(
            self.hidden,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate,
            cache.shape[1],
            cache.shape[2],
            block_tables.stride(0),
            self.eps,
            self.scale,
        )
        status = self.library.decode_layers(
            self.layers,
            len(self.layers),
            ctypes.byref(shape),
            rows,
            threads,
            ctypes.c_void_p(hidden.data_ptr()),
            ctypes.c_void_p(cos.data_ptr()),
            ctypes.c_void_p(sin.data_ptr()),
            ctypes.c_void_p(block_tables.data_ptr()),
            ctypes.c_void_p(seq_lens.data_ptr()),
            ctypes.c_void_p(slot_mapping.data_ptr()),
            ctypes.c_void_p(self.scratch.data_ptr()),
        )
        if status:
            raise RuntimeError(f"native decode rejected its inputs (status {status})")
        return hidden

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
