"""Decode steps of a Qwen2 or Gemma 3 decoder stack on CPU in one native call (`cpu_decode.c`).

A batch-1 decode step is bound by reading the weights, but op by op in torch each of a layer's
~40 small ops also costs a fixed few microseconds, every parallel op wakes the thread pool
again, and the first ops after the weights have streamed through the caches run cold (the
final norm took 0.3 ms there, 0.07 ms when repeated); on the 2-core CPU that overhead was larger
than the layers' own weight reads. The C kernel goes from token ids to the final norm (embedding
rows, M-RoPE tables, every layer) inside one OpenMP parallel region, the threads meeting at
barriers, reading each weight once in contiguous per-thread bands.

The C file is compiled on first use with the system C compiler (`$CC`, else `cc`) into the
stillcut cache, keyed by the source, the compiler and the CPU. It links libgomp, the OpenMP
runtime torch's Linux wheels have already loaded under the same name, so both share one thread
pool. Without a compiler, or with `STILLCUT_NATIVE_DECODE=0`, `load()` returns None and the
model runs its torch ops instead.
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from stillcut.engine.disk_cache import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
MAX_ROWS = 16  # past this many rows a step is a gemm, torch's own territory
MAX_BLOCK_SIZE = 256  # `MAX_BLOCK` in the C file
MAX_TABLES = 2  # rotary tables per model (Gemma 3: local and global)
ENABLE_VARIABLE = "STILLCUT_NATIVE_DECODE"
COMPILE_TIMEOUT_S = 120


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in (
            "input_norm", "qkv_weight", "qkv_bias", "qk_norm", "o_weight", "attention_out_norm",
            "mlp_norm", "gate_up_weight", "down_weight", "mlp_out_norm", "kv_cache",
        )),
        *((name, ctypes.c_int32) for name in (
            "qkv_out_in", "o_out_in", "gate_up_out_in", "down_out_in", "window", "table",
        )),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("embedding", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("inv_freq", ctypes.c_void_p * MAX_TABLES),
        ("section", ctypes.c_void_p),
        ("embedding_row_stride", ctypes.c_int64),
        ("embedding_column_stride", ctypes.c_int64),
        ("embedding_scale", ctypes.c_float),
        ("soft_cap", ctypes.c_float),
        ("num_tables", ctypes.c_int32),
        ("gelu", ctypes.c_int32),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int32) for name in (
            "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "num_blocks",
            "block_size", "block_table_stride",
        )),
        ("positions_stride", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]  # fmt: skip


class LayerWeights(NamedTuple):
    """One decoder layer as the kernel reads it: fused `[in, out]` projections (either memory
    order, see `engine.models.layers.matmul_layout`), RMSNorm scales as they multiply, and
    None for what a family does not have (Qwen2: no q/k norms, no norms on the residual
    branches; Gemma 3: no bias). `window` 0 attends to every key; `table` picks the rotary
    table."""

    input_norm: torch.Tensor  # [hidden]
    qkv_weight: torch.Tensor  # [hidden, (Hq + 2 Hkv) * D]: q, k, v columns
    o_weight: torch.Tensor  # [Hq * D, hidden]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up_weight: torch.Tensor  # [hidden, 2 * intermediate]: gate, up columns
    down_weight: torch.Tensor  # [intermediate, hidden]
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D]
    qk_norm: torch.Tensor | None = None  # [Hq + Hkv, D]: per q head, then per k head
    attention_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    window: int = 0
    table: int = 0


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
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        key = hashlib.sha256(
            "\0".join((SOURCE.read_text(), compiler, version, *FLAGS, _cpu())).encode()
        ).hexdigest()[:16]
        target = cache_dir() / "native" / f"cpu_decode-{key}.so"
        if not target.exists():
            started = time.perf_counter()
            _compile(compiler, target)
            log.info("compiled the native CPU decode step in %.1f s", time.perf_counter() - started)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("native CPU decode unavailable, using torch ops: %s", detail)
        return None
    library.decode_step.restype = ctypes.c_int
    return library


def bind(layers: Sequence[LayerWeights], **model) -> CpuDecoder | None:
    """A `CpuDecoder` of these layers (`model`: its keyword arguments), or None where the
    kernel cannot serve: not float32 on CPU, or no library here (see `load`)."""
    first = layers[0].qkv_weight
    if first.dtype != torch.float32 or not first.is_cpu:
        return None
    library = load()
    return None if library is None else CpuDecoder(library, layers, **model)


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
            timeout=COMPILE_TIMEOUT_S,
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


class CpuDecoder:
    """A decoder-only language model from token ids to its final norm, bound to the C kernel
    for steps of decodes only (see `supports`); the model files say what their layers are.

    `embedding` is the `[vocab, hidden]` table (any strides: a tied model's is the head's
    transpose), scaled by `embedding_scale`; `inv_freqs` the rotary tables' frequencies `[D/2]`
    and `section` `[D/2]` the position row each frequency turns with (M-RoPE; zeros for 1-D
    positions); `scale` multiplies attention scores before the optional `soft_cap`; `gelu`
    picks tanh GELU over SiLU. Everything float32 on CPU; the tensors must outlive this
    object, which keeps only their addresses.
    """

    def __init__(
        self,
        library: ctypes.CDLL,
        layers: Sequence[LayerWeights],
        *,
        num_heads: int,
        num_kv_heads: int,
        embedding: torch.Tensor,
        final_norm: torch.Tensor,
        inv_freqs: Sequence[torch.Tensor],
        section: torch.Tensor,
        eps: float,
        scale: float,
        embedding_scale: float = 1.0,
        soft_cap: float | None = None,
        gelu: bool = False,
    ) -> None:
        if not 1 <= len(inv_freqs) <= MAX_TABLES:
            raise ValueError(f"{len(inv_freqs)} rotary tables; the kernel takes 1 to {MAX_TABLES}")
        self.library = library
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.hidden = final_norm.shape[0]
        self.head_dim = layers[0].o_weight.shape[0] // num_heads
        self.intermediate = layers[0].down_weight.shape[0]
        self.eps, self.scale = eps, scale
        self.layers = (_Layer * len(layers))()
        for slot, layer in zip(self.layers, layers, strict=True):
            for name, tensor in layer._asdict().items():
                if isinstance(tensor, torch.Tensor):
                    setattr(slot, name, _float32_cpu(name, tensor).data_ptr())
                    if name.endswith("_weight"):
                        setattr(slot, name.replace("weight", "out_in"), _out_in(tensor))
            slot.window, slot.table = layer.window, layer.table
            if not 0 <= layer.table < len(inv_freqs):
                raise ValueError(f"layer rotary table {layer.table} of {len(inv_freqs)}")
        # kept: the kernel reads them
        self.section = section.to(torch.int32).contiguous()
        self.inv_freqs = [_float32_cpu("inv_freq", f).contiguous() for f in inv_freqs]
        self.model = _Model(
            _float32_cpu("embedding", embedding).data_ptr(),
            _float32_cpu("final_norm", final_norm).data_ptr(),
            (ctypes.c_void_p * MAX_TABLES)(*(f.data_ptr() for f in self.inv_freqs)),
            self.section.data_ptr(),
            embedding.stride(0),
            embedding.stride(1),
            embedding_scale,
            soft_cap or 0.0,
            len(self.inv_freqs),
            int(gelu),
        )
        self.kv_caches: tuple[int, ...] = ()
        self.scratch = torch.empty(0)

    def __reduce__(self):
        """A copied or pickled model holds no decoder (this one keeps the original's weight
        addresses): the copy runs its torch ops."""
        return (type(None), ())

    def supports(
        self, input_ids: torch.Tensor, kv_caches: Sequence[torch.Tensor], metadata
    ) -> bool:
        """Whether this step can run here: on CPU, each row the single new token of its own
        request (a step of decodes only), no more than `MAX_ROWS`, a float32 KV cache."""
        rows = input_ids.shape[0]
        return (
            input_ids.is_cpu
            and 0 < rows <= MAX_ROWS
            and metadata.max_query_len == 1
            and metadata.seq_lens.shape[0] == rows
            and metadata.mm_ranges is None
            and metadata.block_tables.dtype == metadata.seq_lens.dtype == torch.int32
            and metadata.slot_mapping.dtype == torch.int64
            and kv_caches[0].dtype == torch.float32
            and kv_caches[0].shape[2] <= MAX_BLOCK_SIZE
            and all(cache.is_contiguous() for cache in kv_caches)
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        metadata,
    ) -> torch.Tensor:
        """The final-normed hidden states [rows, hidden] of `input_ids` [rows] at `positions`
        [position rows, rows]; their keys and values go into `kv_caches` like the model's own
        layers put them."""
        rows = input_ids.shape[0]
        input_ids = input_ids.to(torch.int64).contiguous()
        positions = positions.to(torch.int64)
        if positions.stride(1) != 1:
            positions = positions.contiguous()
        addresses = tuple(cache.data_ptr() for cache in kv_caches)
        if addresses != self.kv_caches:
            for slot, address in zip(self.layers, addresses, strict=True):
                slot.kv_cache = address
            self.kv_caches = addresses
        threads = torch.get_num_threads()
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        needed = rows * (
            3 * self.hidden
            + 2 * len(self.inv_freqs) * self.head_dim
            + qkv_width
            + self.num_heads * self.head_dim
            + 2 * self.intermediate
            + self.num_heads * threads * (self.head_dim + 2)
            + threads * max(qkv_width, self.hidden, 2 * self.intermediate)
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
            positions.stride(0),
            self.eps,
            self.scale,
        )
        out = torch.empty(rows, self.hidden)
        status = self.library.decode_step(
            ctypes.byref(self.model),
            self.layers,
            len(self.layers),
            ctypes.byref(shape),
            rows,
            threads,
            *(
                ctypes.c_void_p(tensor.data_ptr())
                for tensor in (
                    input_ids,
                    positions,
                    block_tables,
                    seq_lens,
                    slot_mapping,
                    self.scratch,
                    out,
                )
            ),
        )
        if status:
            raise RuntimeError(f"native decode rejected its inputs (status {status})")
        return out


def _float32_cpu(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != torch.float32 or not tensor.is_cpu:
        raise ValueError(f"{name} must be a float32 CPU tensor, got {tensor.dtype}")
    return tensor
