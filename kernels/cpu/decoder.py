"""Decode steps of a decoder stack on CPU in one native call (`decode.c`).

A batch-1 decode step is bound by reading the weights, but op by op in torch each of a layer's
~40 small ops also costs a fixed few microseconds, every parallel op wakes the thread pool
again, and the first ops after the weights have streamed through the caches run cold (the
final norm took 0.3 ms there, 0.07 ms when repeated); on the 2-core CPU that overhead was larger
than the layers' own weight reads. The C kernel goes from token ids to the final norm (embedding
rows, M-RoPE tables, every block) inside one OpenMP parallel region, the threads meeting at
barriers, reading each weight once in contiguous per-thread bands. A model describes itself as
a `stack.Stack` of blocks, each of a kind; `bind` turns that into the C structs.
Recurrent blocks (Mamba2, Gated DeltaNet) advance the runner's state rows in place
(`metadata.recurrent`); the snapshots a step asks for are copied from those rows after it.
Weights stay in their stored formats (bfloat16, float16, int8 with per-column scales, float32;
`formats.h` widens them in registers), and the KV caches may be bfloat16. `NativeMatrix`
runs the same products one at a time, for the few-row products outside a decode step (the LM
head, the torch path's).

The library is built and loaded by `library.load` (None without a compiler, or with
`STILLCUT_NATIVE_DECODE=0`: the model then runs its torch ops).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import operator
from collections.abc import Iterator, Sequence

import torch

from stillcut.kernels.cpu.library import load
from stillcut.kernels.cpu.packing import FORMATS, is_packed, is_quads, matrix_shape, panels_shape
from stillcut.kernels.cpu.stack import (
    MAX_TABLES,
    RECURRENT_MIXERS,
    Attention,
    Block,
    GatedDelta,
    GatedMlp,
    Kind,
    Mamba2,
    Mlp,
    Moe,
    SoftmaxMoe,
    Stack,
)
from stillcut.kernels.cpu.structs import (
    MAX_BLOCK_SIZE,
    PANELS,
    QUADS,
    _Attention,
    _Block,
    _Embedding,
    _GatedDelta,
    _GatedMlp,
    _Mamba2,
    _Matrix,
    _Mlp,
    _Model,
    _Moe,
    _SoftmaxMoe,
    _Step,
)

log = logging.getLogger(__name__)

KV_FORMATS = (torch.float32, torch.bfloat16)
MAX_ROWS = 16  # past this many rows a step is a gemm, torch's own territory


def bind(stack: Stack) -> CpuDecoder | None:
    """A `CpuDecoder` of `stack`, or None where the kernel cannot serve it: a tensor not on
    CPU, a weight in no stored format (`FORMATS`) or another tensor not float32, or no library
    here (see `load`)."""
    for tensor, is_weight in _tensors(stack):
        wanted = tensor.dtype in FORMATS if is_weight else tensor.dtype == torch.float32
        if not (wanted and tensor.is_cpu):
            return None
    library = load()
    return None if library is None else CpuDecoder(library, stack)


def _tensors(stack: Stack) -> Iterator[tuple[torch.Tensor, bool]]:
    """Every tensor the kernel reads of `stack`, and whether it is a weight (the embedding or
    a `*_weight`: in a stored format; the rest is float32)."""
    yield stack.embedding, True
    yield from ((tensor, False) for tensor in (stack.final_norm, *stack.inv_freqs))
    if stack.embedding_scales is not None:
        yield stack.embedding_scales, False
    parts = [part for block in stack.blocks for part in (block, block.mixer)]
    while parts:
        part = parts.pop()
        for field in dataclasses.fields(part):
            value = getattr(part, field.name)
            if isinstance(value, torch.Tensor):
                yield value, field.name.endswith("_weight")
            elif dataclasses.is_dataclass(value):  # a part of the mixer (an MoE's shared MLP)
                parts.append(value)


def _out_in(weight: torch.Tensor) -> int:
    """1 when `weight` `[in, out]` is the view of a contiguous `[out, in]` (float32 only), 0
    when it is a contiguous `[in, out]` itself or packed (`packing.pack_matrix`)."""
    if weight.is_contiguous():
        return 0
    if weight.T.is_contiguous() and weight.dtype == torch.float32:
        return 1
    raise ValueError(
        f"{weight.dtype} weight of shape {tuple(weight.shape)} is in no layout the kernel reads"
    )


def _as_read(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as the kernel reads it: contiguous, of `dtype` (a copy only where it is not)."""
    if tensor.dtype is dtype and tensor.is_contiguous():
        return tensor
    return tensor.to(dtype).contiguous()


class _Kept:
    """What the kernel reads by address: aliases of tensors (their storage stays alive whatever
    becomes of the tensors themselves) and ctypes structs."""

    def __init__(self) -> None:
        self.kept: list[object] = []

    def _address(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        alias = tensor.detach()  # the same storage, whatever becomes of `tensor` itself
        self.kept.append(alias)
        return alias.data_ptr()

    def _matrix(self, weight: torch.Tensor | None, scale: torch.Tensor | None = None) -> _Matrix:
        if weight is None:
            return _Matrix()  # none: the kernel reads no data
        return _Matrix(
            self._address(weight),
            self._address(scale),
            FORMATS[weight.dtype],
            _out_in(weight),
            *matrix_shape(weight),
            QUADS if is_quads(weight) else int(is_packed(weight)),
        )

    def _any_matrix(self, weight: torch.Tensor, scale: torch.Tensor | None) -> _Matrix:
        """`_matrix`, or an LM head's panels `[out / 32, in, 32]`."""
        if weight.dim() != 3:
            return self._matrix(weight, scale)
        return _Matrix(
            self._address(weight),
            self._address(scale),
            FORMATS[weight.dtype],
            0,
            *panels_shape(weight),
            PANELS,
        )


class NativeMatrix(_Kept):
    """One weight `[in, out]` (any stored format and layout, an LM head's panels `[out / 32,
    in, 32]` too; int8 with its per-column `scale`) bound to the kernel's product, for few-row
    products outside a decode step. It keeps the weight's storage alive; rebuilding it for new
    weights is its owner's job."""

    def __init__(self, library: ctypes.CDLL, weight: torch.Tensor, scale: torch.Tensor | None):
        super().__init__()
        self.library = library
        self.matrix = self._any_matrix(weight, scale)
        self.num_out = self.matrix.num_out
        self.matrix_address = ctypes.addressof(self.matrix)
        self.partials = torch.empty(0)

    def __reduce__(self):
        """A copied model holds no native matrices: it makes its own (see `__call__`'s
        owner)."""
        return (type(None), ())

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """`x` `[rows, in]` float32 (rows contiguous) @ the weight (+ `add` `[rows, out]`, or a
        bias `[out]`) -> float32 `[rows, out]`."""
        rows, threads = x.shape[0], torch.get_num_threads()
        if x.stride(1) != 1:
            x = x.contiguous()
        if add is not None:
            add = add.expand(rows, self.num_out).contiguous()
        needed = threads * rows * self.num_out
        if self.partials.numel() < needed:
            self.partials = torch.empty(needed)
        out = torch.empty(rows, self.num_out)
        status = self.library.matmul(
            self.matrix_address,
            x.data_ptr(),
            x.stride(0),
            rows,
            None if add is None else add.data_ptr(),
            out.data_ptr(),
            self.partials.data_ptr(),
            threads,
        )
        if status:
            raise RuntimeError(f"the native product rejected its matrix (status {status})")
        return out


def native_matrix(weight: torch.Tensor, scale: torch.Tensor | None) -> NativeMatrix | None:
    """`weight` bound to the kernel's product, or None without a library or off the CPU."""
    library = load()
    if library is None or not weight.is_cpu or weight.dtype not in FORMATS:
        return None
    return NativeMatrix(library, weight, scale)


class CpuDecoder(_Kept):
    """A `Stack` from token ids to its final norm, bound to the C kernel for steps of decodes
    only (see `supports`).

    The kernel reads the stack's tensors by address: the decoder keeps their storage alive (an
    alias of each), so whatever later happens to the model's parameters it never reads freed
    memory; noticing that the model now holds other weights is its owner's job (see
    `engine.models.base.PagedLanguageModel.native_decode`)."""

    def __init__(self, library: ctypes.CDLL, stack: Stack) -> None:
        super().__init__()
        self.library = library
        self.hidden = stack.hidden
        # the recurrent blocks' keys in the step's `recurrent.states`, and their state shapes
        recurrent = [b.mixer for b in stack.blocks if isinstance(b.mixer, RECURRENT_MIXERS)]
        self.state_shapes = {mixer.state: mixer.state_shapes for mixer in recurrent}
        self.state_layers = tuple(self.state_shapes)
        if len(self.state_layers) != len(recurrent):
            raise ValueError("two recurrent blocks share one state")
        self.blocks = (_Block * len(stack.blocks))(*map(self._block, stack.blocks))
        self.vocab = 0  # the head's outputs (`_head`); 0: no head
        self.model = self._model(stack)
        self.model_address = ctypes.addressof(self.model)
        status = library.check_model(ctypes.byref(self.model), self.blocks, len(self.blocks))
        if status:
            raise RuntimeError(f"the native decode step rejected the stack (status {status})")
        self.cache_heads = _cache_heads(stack)  # KV cache index -> (Hkv, D)
        self.num_kv_caches = max(self.cache_heads, default=-1) + 1
        self.cache_shapes: dict[tuple[int, int], list[tuple[int, tuple[int, ...]]]] = {}
        self.scratch_sizes: dict[tuple[int, int], int] = {}
        self.kv_caches: tuple[int, ...] = ()
        self.fitting_caches: tuple[torch.Tensor, ...] = ()  # the caches last seen to fit
        self.kv_cache_array = (ctypes.c_void_p * 0)()
        self.states: tuple[torch.Tensor, ...] = ()  # the recurrent states last seen to fit
        self.state_array = (ctypes.c_void_p * 0)()
        # a step's state row and freshness per row, as the kernel reads them
        self.state_rows = (ctypes.c_int32 * MAX_ROWS)()
        self.fresh = (ctypes.c_uint8 * MAX_ROWS)()
        self.state_rows_address = ctypes.addressof(self.state_rows)
        self.fresh_address = ctypes.addressof(self.fresh)
        self.scratch = torch.empty(0)

    def __reduce__(self):
        """A copied or pickled model holds no decoder (this one reads the original's weights):
        the copy makes its own (see `PagedLanguageModel.native_decode`)."""
        return (type(None), ())

    def _block(self, block: Block) -> _Block:
        params = _PARAMS[block.mixer.kind](self, block.mixer)
        self.kept.append(params)
        return _Block(
            block.mixer.kind,
            self._address(block.norm),
            self._address(block.out_norm),
            ctypes.addressof(params),
        )

    def _model(self, stack: Stack) -> _Model:
        embedding = stack.embedding
        # a tied head's panels (1; int8 quad panels: 2): a row of 32 ids, then its rows
        panels = 2 if is_quads(embedding) else int(embedding.dim() == 3)
        table = _Embedding(
            self._address(embedding),
            self._address(stack.embedding_scales),
            embedding.stride(0),
            embedding.stride(1),
            FORMATS[embedding.dtype],
            stack.embedding_scale,
            panels,
        )
        return _Model(
            table,
            self._address(stack.final_norm),
            (ctypes.c_void_p * MAX_TABLES)(*map(self._address, stack.inv_freqs)),
            self._address(stack.section.to(torch.int32).contiguous()),
            stack.hidden,
            len(stack.inv_freqs),
            2 * stack.section.shape[0],
            stack.eps,
            self._head(stack),
        )

    def _head(self, stack: Stack) -> int | None:
        """The address of the head's matrix (kept alive here), None without one."""
        if stack.head is None:
            return None
        head = self._any_matrix(stack.head, stack.head_scales)
        self.kept.append(head)
        self.vocab = head.num_out
        return ctypes.addressof(head)

    def supports(
        self, input_ids: torch.Tensor, kv_caches: Sequence[torch.Tensor], metadata
    ) -> bool:
        """Whether this step can run here: on CPU, each row the single new token of its own
        request (a step of decodes only), no more than `MAX_ROWS`, KV caches of the blocks'
        shapes, all float32 or all bfloat16, and (recurrent blocks) float32 states of theirs
        in `metadata.recurrent`."""
        rows = input_ids.shape[0]
        return (
            input_ids.is_cpu
            and 0 < rows <= MAX_ROWS
            and metadata.max_query_len == 1
            and metadata.seq_lens.shape[0] == rows
            and metadata.mm_ranges is None
            and metadata.block_tables.dtype == metadata.seq_lens.dtype == torch.int32
            and metadata.slot_mapping.dtype == torch.int64
            and self._caches_fit(kv_caches)
            and self._states_fit(metadata.recurrent, rows)
        )

    def _states_fit(self, recurrent, rows: int) -> bool:
        """The recurrent blocks' states in `recurrent` (a `kernels.mamba2.RecurrentMetadata`):
        float32, contiguous, of the blocks' shapes, with one slot count; no recurrent blocks,
        no states needed."""
        if not self.state_layers:
            return True
        if recurrent is None or len(recurrent.state_rows_cpu) != rows:
            return False
        if not recurrent.prompt_token_mask.is_cpu:
            return False
        try:
            states = tuple(t for layer in self.state_layers for t in recurrent.states[layer])
        except KeyError:
            return False
        if len(states) == len(self.states) and all(map(operator.is_, states, self.states)):
            return True  # the runner's persistent tensors, checked when first seen
        slots = states[0].shape[0] if states else 0
        shapes = [shape for layer in self.state_layers for shape in self.state_shapes[layer]]
        if len(states) != len(shapes) or not all(
            t.dtype == torch.float32 and t.is_contiguous() and t.is_cpu and t.shape == (slots, *s)
            for t, s in zip(states, shapes, strict=True)
        ):
            return False
        self.states = states
        self.state_array = (ctypes.c_void_p * len(states))(*(t.data_ptr() for t in states))
        return True

    def _caches_fit(self, kv_caches: Sequence[torch.Tensor]) -> bool:
        if not self.num_kv_caches:
            return True
        if len(kv_caches) < self.num_kv_caches:
            return False
        caches = tuple(kv_caches[: self.num_kv_caches])
        fitting = self.fitting_caches
        if len(fitting) == len(caches) and all(map(operator.is_, caches, fitting)):
            return True  # the runner's persistent caches, checked when first seen
        if not self._cache_shapes_fit(kv_caches):
            return False
        self.fitting_caches = caches
        return True

    def _cache_shapes_fit(self, kv_caches: Sequence[torch.Tensor]) -> bool:
        num_blocks, block_size = kv_caches[0].shape[1:3]
        expected = self.cache_shapes.get((num_blocks, block_size))
        if expected is None:
            expected = [
                (index, (2, num_blocks, block_size, *heads))
                for index, heads in self.cache_heads.items()
            ]
            self.cache_shapes[num_blocks, block_size] = expected
        dtype = kv_caches[0].dtype
        return (
            block_size <= MAX_BLOCK_SIZE
            and dtype in KV_FORMATS
            and all(
                kv_caches[index].dtype == dtype
                and kv_caches[index].is_contiguous()
                and kv_caches[index].shape == shape
                for index, shape in expected
            )
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
        return self.decode(input_ids, positions, kv_caches, metadata, with_logits=False)[0]

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        metadata,
        with_logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`__call__`'s hidden states and, `with_logits` where the stack has a head, their
        float32 logits [rows, vocab] through it, made in the same native call (else None)."""
        rows = input_ids.shape[0]
        input_ids = _as_read(input_ids, torch.int64)
        if positions.dtype is not torch.int64:
            positions = positions.to(torch.int64)
        if positions.stride(1) != 1:
            positions = positions.contiguous()
        addresses = tuple(cache.data_ptr() for cache in kv_caches[: self.num_kv_caches])
        if addresses != self.kv_caches:
            self.kv_caches = addresses
            self.kv_cache_array = (ctypes.c_void_p * len(addresses))(*addresses)
        block_tables = metadata.block_tables
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        seq_lens = _as_read(metadata.seq_lens, torch.int32)
        slot_mapping = _as_read(metadata.slot_mapping, torch.int64)
        recurrent = metadata.recurrent if self.state_layers else None
        if self.state_layers and not self._states_fit(recurrent, rows):
            raise ValueError("the step's recurrent states are not the blocks' (see `supports`)")
        step = _Step(
            rows,
            torch.get_num_threads(),
            input_ids.data_ptr(),
            positions.data_ptr(),
            positions.stride(0),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            slot_mapping.data_ptr(),
            ctypes.addressof(self.kv_cache_array),
            len(addresses),
            *(kv_caches[0].shape[1:3] if addresses else (0, 0)),  # blocks, block size
            FORMATS[kv_caches[0].dtype] if addresses else FORMATS[torch.float32],
        )
        if recurrent is not None:  # read by the kernel: kept until it returns
            step.states = ctypes.addressof(self.state_array)
            step.num_states = len(self.state_layers)
            step.state_slots = self.states[0].shape[0]
            self.state_rows[:rows] = recurrent.state_rows_cpu
            self.fresh[:rows] = recurrent.fresh
            step.state_rows = self.state_rows_address
            step.fresh = self.fresh_address
            prompt = _as_read(recurrent.prompt_token_mask, torch.bool)  # read as uint8
            step.prompt = prompt.data_ptr()
        self._fit_scratch(step)
        out = torch.empty(rows, self.hidden)
        logits = torch.empty(rows, self.vocab) if with_logits and self.vocab else None
        status = self.library.decode_step(
            self.model_address,
            self.blocks,
            len(self.blocks),
            ctypes.addressof(step),
            self.scratch.data_ptr(),
            out.data_ptr(),
            None if logits is None else logits.data_ptr(),
        )
        if status:
            raise RuntimeError(f"native decode rejected its inputs (status {status})")
        if recurrent is not None and any(recurrent.captures):
            self._save_snapshots(recurrent)
        return out, logits

    def _save_snapshots(self, recurrent) -> None:
        """The states each row's capture asks for (after its one token: what its state row
        now holds) into their snapshot slots, for every recurrent block."""
        for row, captures in zip(recurrent.state_rows_cpu, recurrent.captures, strict=True):
            for _, slot in captures:
                for layer in self.state_layers:
                    states = recurrent.states[layer]
                    for state, snapshot in zip(states, recurrent.snapshots[layer], strict=True):
                        snapshot[slot] = state[row]

    def _fit_scratch(self, step: _Step) -> None:
        """Grow the scratch to what the kernel needs for the step's rows and threads."""
        key = step.rows, step.threads
        needed = self.scratch_sizes.get(key)
        if needed is None:
            needed = self.library.scratch_floats(
                ctypes.byref(self.model), self.blocks, len(self.blocks), ctypes.byref(step)
            )
            self.scratch_sizes[key] = needed
        if self.scratch.numel() < needed:
            self.scratch = torch.empty(needed)


def _attention_params(decoder: CpuDecoder, mixer: Attention) -> _Attention:
    return _Attention(
        decoder._matrix(mixer.qkv_weight, mixer.qkv_scale),
        decoder._matrix(mixer.o_weight, mixer.o_scale),
        decoder._address(mixer.qkv_bias),
        decoder._address(mixer.qk_norm),
        mixer.num_heads,
        mixer.num_kv_heads,
        mixer.head_dim,
        mixer.window,
        -1 if mixer.table is None else mixer.table,
        mixer.cache,
        mixer.scale,
        mixer.soft_cap,
        mixer.gated,
    )


def _gated_mlp_params(decoder: CpuDecoder, mixer: GatedMlp) -> _GatedMlp:
    return _GatedMlp(
        decoder._matrix(mixer.gate_up_weight, mixer.gate_up_scale),
        decoder._matrix(mixer.down_weight, mixer.down_scale),
        mixer.activation,
    )


def _mlp_params(decoder: CpuDecoder, mixer: Mlp) -> _Mlp:
    return _Mlp(
        decoder._matrix(mixer.up_weight, mixer.up_scale),
        decoder._matrix(mixer.down_weight, mixer.down_scale),
        decoder._address(mixer.up_bias),
        decoder._address(mixer.down_bias),
        mixer.activation,
    )


def _experts(decoder: CpuDecoder, weights: torch.Tensor, scales: torch.Tensor | None) -> int:
    """The address of an array of each expert's matrix (kept alive by `decoder`)."""
    array = (_Matrix * weights.shape[0])(*(
        decoder._matrix(weights[e], None if scales is None else scales[e])
        for e in range(weights.shape[0])
    ))  # fmt: skip
    decoder.kept.append(array)
    return ctypes.addressof(array)


def _moe_params(decoder: CpuDecoder, mixer: Moe) -> _Moe:
    return _Moe(
        decoder._matrix(mixer.router),
        decoder._address(mixer.correction_bias),
        _experts(decoder, mixer.experts_up_weight, mixer.experts_up_scale),
        _experts(decoder, mixer.experts_down_weight, mixer.experts_down_scale),
        _mlp_params(decoder, mixer.shared),
        decoder._matrix(mixer.latent_in_weight, mixer.latent_in_scale),
        decoder._matrix(mixer.latent_out_weight, mixer.latent_out_scale),
        decoder._address(mixer.latent_in_bias),
        decoder._address(mixer.latent_out_bias),
        mixer.num_experts,
        mixer.top_k,
        mixer.num_groups,
        mixer.kept_groups,
        mixer.normalize,
        mixer.scaling,
    )


def _softmax_moe_params(decoder: CpuDecoder, mixer: SoftmaxMoe) -> _SoftmaxMoe:
    shared = mixer.shared
    return _SoftmaxMoe(
        decoder._matrix(mixer.router),
        _experts(decoder, mixer.experts_gate_up_weight, mixer.experts_gate_up_scale),
        _experts(decoder, mixer.experts_down_weight, mixer.experts_down_scale),
        _GatedMlp() if shared is None else _gated_mlp_params(decoder, shared),
        decoder._matrix(mixer.shared_gate_weight, mixer.shared_gate_scale),
        mixer.num_experts,
        mixer.top_k,
        mixer.activation,
    )


def _mamba2_params(decoder: CpuDecoder, mixer: Mamba2) -> _Mamba2:
    vectors = (
        mixer.in_proj_bias, mixer.out_proj_bias, mixer.conv_weight.contiguous(), mixer.conv_bias,
        mixer.dt_bias, mixer.A, mixer.D, mixer.gate_norm,
    )  # fmt: skip
    return _Mamba2(
        decoder._matrix(mixer.in_proj_weight, mixer.in_proj_scale),
        decoder._matrix(mixer.out_proj_weight, mixer.out_proj_scale),
        *map(decoder._address, vectors),
        mixer.num_heads,
        matrix_shape(mixer.out_proj_weight)[0] // mixer.num_heads,
        mixer.state_size,
        mixer.num_groups,
        mixer.conv_weight.shape[1],
        decoder.state_layers.index(mixer.state),
        mixer.time_step_min,
    )


def _gated_delta_params(decoder: CpuDecoder, mixer: GatedDelta) -> _GatedDelta:
    vectors = (mixer.conv_weight.contiguous(), mixer.dt_bias, mixer.A, mixer.gate_norm)
    return _GatedDelta(
        decoder._matrix(mixer.in_proj_weight, mixer.in_proj_scale),
        decoder._matrix(mixer.out_proj_weight, mixer.out_proj_scale),
        *map(decoder._address, vectors),
        mixer.num_k_heads,
        mixer.num_v_heads,
        mixer.k_dim,
        mixer.v_dim,
        mixer.conv_weight.shape[1],
        decoder.state_layers.index(mixer.state),
    )


_PARAMS = {
    Kind.ATTENTION: _attention_params,
    Kind.GATED_MLP: _gated_mlp_params,
    Kind.MLP: _mlp_params,
    Kind.MOE: _moe_params,
    Kind.SOFTMAX_MOE: _softmax_moe_params,
    Kind.MAMBA2: _mamba2_params,
    Kind.GATED_DELTA: _gated_delta_params,
}


def _cache_heads(stack: Stack) -> dict[int, tuple[int, int]]:
    """(Hkv, D) of each KV cache the attention blocks use, by cache index; each cache is one
    block's own."""
    heads = {}
    for block in stack.blocks:
        mixer = block.mixer
        if isinstance(mixer, Attention):
            if mixer.cache in heads:
                raise ValueError(f"KV cache {mixer.cache} is used by two attention blocks")
            heads[mixer.cache] = (mixer.num_kv_heads, mixer.head_dim)
    return heads
