"""Decode steps of a Qwen2 decoder stack on CPU in one native call (`cpu_decode.c`).

A batch-1 decode step is bound by reading the weights, but op by op in torch each of a layer's
~40 small ops also costs a fixed few microseconds, every parallel op wakes the thread pool
again, and the first ops after the weights have streamed through the caches run cold (the
final norm took 0.3 ms there, 0.07 ms when repeated); on the 2-core CPU that overhead was larger
than the layers' own weight reads. The C kernel goes from token ids to the final norm (embedding
rows, M-RoPE tables, every layer) inside one OpenMP parallel region, the threads meeting at
barriers, reading each weight once in contiguous per-thread bands.

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


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("embedding", "final_norm", "inv_freq", "section")),
        ("embedding_row_stride", ctypes.c_int64),
        ("embedding_column_stride", ctypes.c_int64),
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
    library.decode_step.restype = ctypes.c_int
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
    """A Qwen2 language model (`engine.models.qwen2`) from token ids to its final norm, bound to
    the C kernel for steps of decodes only (see `supports`).

    `layers` are the model's decoder layers (fused `[in, out]` weights), `embedding` its
    `[vocab, hidden]` table (any strides: a tied model's is the head's transpose), `final_norm`
    its last RMSNorm weight and `inv_freq`, `section` its M-RoPE frequencies and their position
    rows. All float32 on CPU; they must outlive this object, which keeps only their addresses.
    """

    def __init__(
        self,
        library: ctypes.CDLL,
        layers: Sequence[torch.nn.Module],
        embedding: torch.Tensor,
        final_norm: torch.Tensor,
        inv_freq: torch.Tensor,
        section: torch.Tensor,
        eps: float,
    ) -> None:
        self.library = library
        first = layers[0]
        self.hidden = final_norm.shape[0]
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim = first.o_weight.shape[0] // self.num_heads
        self.intermediate = first.down_weight.shape[0]
        self.eps, self.scale = eps, first.scale
        self.layers = (_Layer * len(layers))()
        for slot, layer in zip(self.layers, layers, strict=True):
            for name in ("qkv_weight", "qkv_bias", "o_weight", "gate_up_weight", "down_weight"):
                tensor = _float32_cpu(name, getattr(layer, name))
                setattr(slot, name, tensor.data_ptr())
                if name != "qkv_bias":
                    setattr(slot, name.replace("weight", "out_in"), _out_in(tensor))
            slot.input_norm = _float32_cpu("norm", layer.input_layernorm).data_ptr()
            slot.post_norm = _float32_cpu("norm", layer.post_attention_layernorm).data_ptr()
        self.section = section.to(torch.int32).contiguous()  # kept: the kernel reads it
        self.inv_freq = _float32_cpu("inv_freq", inv_freq).contiguous()
        self.model = _Model(
            _float32_cpu("embedding", embedding).data_ptr(),
            _float32_cpu("final_norm", final_norm).data_ptr(),
            self.inv_freq.data_ptr(),
            self.section.data_ptr(),
            embedding.stride(0),
            embedding.stride(1),
        )
        self.kv_caches: tuple[int, ...] = ()
        self.scratch = torch.empty(0)

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
        """The final-normed hidden states [rows, hidden] of `input_ids` [rows] at M-RoPE
        `positions` [3, rows]; their keys and values go into `kv_caches` like the model's own
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
            2 * self.hidden
            + 2 * self.head_dim
            + qkv_width
            + self.num_heads * self.head_dim
            + 2 * self.intermediate
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
