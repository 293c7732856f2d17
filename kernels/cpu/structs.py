"""The ctypes mirrors of the native decode step's C structs (`decode.c` and the headers it
includes): field for field, in order, of the same types. A test compiles a program that prints
each C struct's size and field offsets and compares them with these (`C_NAMES` maps the fields
whose C names are Python keywords).
"""

from __future__ import annotations

import ctypes

from stillcut.kernels.cpu.stack import MAX_TABLES

MAX_BLOCK_SIZE = 256  # `MAX_BLOCK` in `step.h`
PANELS = 2  # `Matrix.packed` of a matrix stored as panels, `PANELS` in `formats.h`
QUADS = 3  # `Matrix.packed` of an int8 matrix as quad panels, `QUADS` in `formats.h`
C_NAMES = {"num_in": "in", "num_out": "out"}  # a mirror's field -> the C struct's


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        *((name, ctypes.c_int32) for name in ("format", "out_in", "num_in", "num_out", "packed")),
    ]


class _Attention(ctypes.Structure):
    _fields_ = [
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("qkv_bias", ctypes.c_void_p),
        ("qk_norm", ctypes.c_void_p),
        *((name, ctypes.c_int32) for name in (
            "num_heads", "num_kv_heads", "head_dim", "window", "table", "cache",
        )),
        ("scale", ctypes.c_float),
        ("soft_cap", ctypes.c_float),
        ("gated", ctypes.c_int32),
    ]  # fmt: skip


class _GatedMlp(ctypes.Structure):
    _fields_ = [("gate_up", _Matrix), ("down", _Matrix), ("activation", ctypes.c_int32)]


class _Mlp(ctypes.Structure):
    _fields_ = [
        ("up", _Matrix),
        ("down", _Matrix),
        ("up_bias", ctypes.c_void_p),
        ("down_bias", ctypes.c_void_p),
        ("activation", ctypes.c_int32),
    ]


class _Moe(ctypes.Structure):
    _fields_ = [
        ("router", _Matrix),
        ("correction_bias", ctypes.c_void_p),
        ("experts_up", ctypes.c_void_p),
        ("experts_down", ctypes.c_void_p),
        ("shared", _Mlp),
        ("latent_in", _Matrix),
        ("latent_out", _Matrix),
        ("latent_in_bias", ctypes.c_void_p),
        ("latent_out_bias", ctypes.c_void_p),
        *((name, ctypes.c_int32) for name in (
            "num_experts", "top_k", "num_groups", "kept_groups", "normalize",
        )),
        ("scaling", ctypes.c_float),
    ]  # fmt: skip


class _SoftmaxMoe(ctypes.Structure):
    _fields_ = [
        ("router", _Matrix),
        ("experts_gate_up", ctypes.c_void_p),
        ("experts_down", ctypes.c_void_p),
        ("shared", _GatedMlp),
        ("shared_gate", _Matrix),
        *((name, ctypes.c_int32) for name in ("num_experts", "top_k", "activation")),
    ]


class _Mamba2(ctypes.Structure):
    _fields_ = [
        ("in_proj", _Matrix),
        ("out_proj", _Matrix),
        *((name, ctypes.c_void_p) for name in (
            "in_proj_bias", "out_proj_bias", "conv_weight", "conv_bias", "dt_bias", "A", "D",
            "gate_norm",
        )),
        *((name, ctypes.c_int32) for name in (
            "num_heads", "head_dim", "state_size", "num_groups", "kernel", "state",
        )),
        ("time_step_min", ctypes.c_float),
    ]  # fmt: skip


class _GatedDelta(ctypes.Structure):
    _fields_ = [
        ("in_proj", _Matrix),
        ("out_proj", _Matrix),
        *((name, ctypes.c_void_p) for name in ("conv_weight", "dt_bias", "A", "gate_norm")),
        *((name, ctypes.c_int32) for name in (
            "num_k_heads", "num_v_heads", "k_dim", "v_dim", "kernel", "state",
        )),
    ]  # fmt: skip


class _Block(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("norm", ctypes.c_void_p),
        ("out_norm", ctypes.c_void_p),
        ("params", ctypes.c_void_p),
    ]


class _Embedding(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("row_stride", ctypes.c_int64),
        ("column_stride", ctypes.c_int64),
        ("format", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("panels", ctypes.c_int32),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("embedding", _Embedding),
        ("final_norm", ctypes.c_void_p),
        ("inv_freq", ctypes.c_void_p * MAX_TABLES),
        ("section", ctypes.c_void_p),
        *((name, ctypes.c_int32) for name in ("hidden", "num_tables", "rotary_dim")),
        ("eps", ctypes.c_float),
        ("head", ctypes.c_void_p),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("ids", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("positions_stride", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p),
        ("block_table_stride", ctypes.c_int32),
        ("seq_lens", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("kv_caches", ctypes.c_void_p),
        *((name, ctypes.c_int32) for name in (
            "num_kv_caches", "cache_blocks", "block_size", "kv_format",
        )),
        ("states", ctypes.c_void_p),
        ("num_states", ctypes.c_int32),
        ("state_slots", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("state_rows", "fresh", "prompt")),
    ]  # fmt: skip
