"""Checkpoint loading: load a Hugging Face checkpoint's weights into modules.

A checkpoint is a folder with config.json (read once, by `checkpoint.open_checkpoint`) and
safetensors weights, one file or shards with an index. Checkpoints of one family name their
tensors in several layouts (releases, and saves by different transformers versions); the
family's registry entry maps each stored prefix to one canonical naming: `visual.*` (everything
that turns pixels into language-model embeddings), `language_model.*`, `lm_head.*`. Weights are
read through safetensors' memory map one shard at a time, converted to the target dtype once,
and assigned to the module in place of its parameters, so a multi-GB checkpoint is never held
twice (build the module on the meta device to skip allocating and initialising it at all).
With `formats` (see `quantization.plan_formats`), each tensor becomes its planned stored format
on the way in, a block of rows at a time for large ones (a 152k-row embedding never exists in
float32), and int8 tensors bring their scales as `<name>_scale` parameters beside them.

This module imports neither PyAV nor FastAPI: the engine and the GPU machine use it.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Collection, Mapping
from os import PathLike
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from stillcut.engine.anon_memory import release_freed_memory
from stillcut.engine.checkpoint import Checkpoint, CheckpointLike, open_checkpoint
from stillcut.engine.model_config import CheckpointError, ModelConfig
from stillcut.engine.quantization import (
    STORED_DTYPES,
    Conversion,
    quantize_int8,
    quantize_stack,
    row_blocks,
)
from stillcut.kernels.cpu.packing import PANEL_COLUMNS, head_panels_shape, to_head_panels

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "ModelConfig",
    "canonical_tensor_name",
    "checkpoint_tensors",
    "load_weights",
    "checkpoint_dtype",
    "stored_floating_dtype",
]

_MAX_NAMES_IN_ERROR = 8
_T = TypeVar("_T")


def canonical_tensor_name(name: str, prefixes: Mapping[str, str]) -> str:
    """The canonical name of a checkpoint tensor: the longest matching stored prefix of
    `prefixes` (a family's `weight_prefixes`) replaced by its canonical one."""
    for stored_prefix in sorted(prefixes, key=len, reverse=True):
        if name.startswith(stored_prefix):
            return prefixes[stored_prefix] + name[len(stored_prefix) :]
    return name


def checkpoint_tensors(checkpoint: CheckpointLike) -> dict[str, tuple[Path, str]]:
    """Canonical tensor name -> (safetensors file, name stored in it); reads headers only."""
    checkpoint = open_checkpoint(checkpoint)
    folder = checkpoint.folder
    prefixes = checkpoint.config.family.weight_prefixes
    index_file = folder / "model.safetensors.index.json"
    single_file = folder / "model.safetensors"
    if index_file.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError) as error:
            raise CheckpointError(f"{index_file} is not a safetensors index: {error}") from error
        stored = {name: folder / shard for name, shard in weight_map.items()}
        for shard in sorted(set(stored.values())):
            if not shard.is_file():
                raise CheckpointError(f"shard {shard.name} listed in {index_file} is missing")
    elif single_file.is_file():
        with _open_safetensors(single_file) as handle:
            stored = dict.fromkeys(handle.keys(), single_file)
    else:
        raise CheckpointError(f"{folder} has neither model.safetensors nor {index_file.name}")
    tensors: dict[str, tuple[Path, str]] = {}
    for name, file in stored.items():
        canonical = canonical_tensor_name(name, prefixes)
        if canonical in tensors:
            raise CheckpointError(
                f"{folder}: tensors {tensors[canonical][1]!r} and {name!r} "
                f"both map to {canonical!r}"
            )
        tensors[canonical] = (file, name)
    return tensors


def load_weights(
    module: nn.Module,
    path: CheckpointLike,
    prefix: str,
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
    unused: Collection[str] = (),
    formats: Mapping[str, Conversion] | None = None,
) -> None:
    """Load every checkpoint tensor named `prefix + <module state name>` into `module`, strictly.

    Floating tensors are converted to `dtype` (None keeps the stored dtype), or to their entry
    of `formats` (state name -> `Conversion`, every state name planned), and replace the
    module's parameters and buffers, so a module built on the meta device loads too. Parameters
    shared under several names (tied embeddings) need only one of the names in the checkpoint.
    Tensors under `prefix` + one of `unused` are stored parts the model never reads (as
    transformers' own model never reads them): they are skipped, and logged once. Missing
    tensors, other unexpected tensors under `prefix` and wrong shapes raise CheckpointError
    naming them before anything is assigned; an unreadable safetensors file raises naming it.
    """
    checkpoint = open_checkpoint(path)
    path = checkpoint.folder  # what errors name
    stored = {
        name[len(prefix) :]: location
        for name, location in checkpoint_tensors(checkpoint).items()
        if name.startswith(prefix)
    }
    skipped = [name for name in stored if name.startswith(tuple(unused))]
    if skipped:
        log.info("%s: skipping %d unused tensors: %s", path, len(skipped), _name_list(skipped))
        stored = {name: location for name, location in stored.items() if name not in skipped}
    plan = _plan_loads(module, stored, prefix, path)
    targets = module.state_dict(keep_vars=True)
    wrong = []
    for file, loads in plan.items():
        with _open_safetensors(file) as handle:
            for names, stored_name in loads:
                shape = tuple(_read(handle.get_slice, file, stored_name).get_shape())
                expected = tuple(targets[names[0]].shape)
                if shape != expected:
                    wrong.append(f"{prefix}{names[0]} {shape} (expected {expected})")
    if wrong:
        raise CheckpointError(f"{path}: wrong tensor shapes: {_name_list(wrong)}")
    for file, loads in plan.items():
        with _open_safetensors(file, device) as handle:
            for names, stored_name in loads:
                conversion = formats[names[0]] if formats is not None else None
                tensor, scale = _converted(handle, file, stored_name, conversion, dtype, device)
                _assign(module, names, tensor, isinstance(targets[names[0]], nn.Parameter))
                if scale is not None:
                    _assign(module, [f"{name}_scale" for name in names], scale, True)
                if conversion is not None:
                    release_freed_memory()  # the blocks it converted through


def _converted(
    handle,
    file: Path,
    name: str,
    conversion: Conversion | None,
    dtype: torch.dtype | None,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tensor `name` of `file` as it is to be stored, and its int8 scales (else None)."""
    whole = functools.partial(_read, handle.get_tensor, file, name)
    if conversion is None:
        tensor = whole()
        return (
            tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        ), None
    sliced = _read(handle.get_slice, file, name)
    stored = _SAFETENSORS_DTYPES.get(sliced.get_dtype())
    if stored is None or not stored.is_floating_point:
        return whole(), None
    shape = sliced.get_shape()
    quantized = conversion.dtype == torch.int8
    if conversion.through is not None:  # a vector or small table: rounded, then widened
        return whole().to(conversion.through).to(conversion.dtype), None
    if len(shape) < 2 or (quantized and conversion.axis != 0 and not conversion.stacked):
        tensor, scales = quantize_int8(whole(), conversion.axis) if quantized else (whole(), None)
        tensor = tensor.to(conversion.dtype)
        return (tensor.T.contiguous().T if conversion.head else tensor), scales
    if stored == conversion.dtype and not conversion.head:
        return whole(), None
    return _by_rows(sliced, file, name, shape, conversion, device)


def _by_rows(sliced, file: Path, name: str, shape: list[int], conversion: Conversion, device):
    """A matrix converted (quantized along its rows, a stack of matrices each along its
    `axis`; an LM head laid out as panels, an int8 one as quad panels where they fit, or
    transposed in memory, see `Conversion.head`) a block of rows (of matrices) at a time:
    only the result and one block ever exist."""
    quantized = conversion.dtype == torch.int8
    stacked = quantized and conversion.stacked
    layout = None
    if conversion.head:  # panels: each block of rows is whole ones
        layout = head_panels_shape(conversion.dtype, device, *shape)
    panels = layout is not None
    if not panels:
        layout = [shape[1], shape[0], *shape[2:]] if conversion.head else shape
    converted = torch.empty(layout, dtype=conversion.dtype, device=device)
    scales = None
    if quantized:  # a scale per row, or per matrix and output channel
        per_row = [shape[conversion.axis]] if stacked else []
        scales = torch.empty(shape[0], *per_row, dtype=torch.float32)
    unit = PANEL_COLUMNS if panels else 1
    for rows in row_blocks(shape[0], _elements(shape[1:]), unit):
        try:
            block = sliced[rows]
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {error}") from error
        if stacked:
            block, scales[rows] = quantize_stack(block, conversion.axis)
        elif quantized:
            block, scales[rows] = quantize_int8(block, 0)
        if panels:
            converted[rows.start // unit : rows.stop // unit] = to_head_panels(block)
        elif conversion.head:
            converted[:, rows] = block.T
        else:
            converted[rows] = block
        del block
        release_freed_memory()  # the block's temporaries, before the next one is read
    if conversion.head and not panels:
        return converted.T, scales
    return converted, scales


def _elements(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def checkpoint_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The dtype a checkpoint says it is stored in (config.json `dtype` / `torch_dtype`), else
    the dtype of its first floating tensor."""
    raw = checkpoint.config.raw
    for section in (raw, raw.get("text_config") or {}):
        name = section.get("dtype") or section.get("torch_dtype")
        if name in STORED_DTYPES:
            return STORED_DTYPES[name]
    return stored_floating_dtype(checkpoint)


def stored_floating_dtype(checkpoint: CheckpointLike) -> torch.dtype:
    """The dtype of a checkpoint's first floating tensor (its headers only)."""
    checkpoint = open_checkpoint(checkpoint)
    for file, name in checkpoint_tensors(checkpoint).values():
        with _open_safetensors(file) as handle:
            dtype = _SAFETENSORS_DTYPES.get(_read(handle.get_slice, file, name).get_dtype())
        if dtype is not None and dtype.is_floating_point:
            return dtype
    raise CheckpointError(f"{checkpoint.folder} holds no floating tensor")


def _plan_loads(
    module: nn.Module, stored: dict[str, tuple[Path, str]], prefix: str, path: str | PathLike[str]
) -> dict[Path, list[tuple[list[str], str]]]:
    """Safetensors file -> [(state names sharing one tensor, name stored in the file)]."""
    aliases: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        aliases.setdefault(id(tensor), []).append(name)
    plan: dict[Path, list[tuple[list[str], str]]] = {}
    missing = []
    for names in aliases.values():
        found = next((name for name in names if name in stored), None)
        if found is None:
            missing.append(prefix + names[0])
        else:
            file, stored_name = stored[found]
            plan.setdefault(file, []).append((names, stored_name))
    known = {name for names in aliases.values() for name in names}
    unexpected = [prefix + name for name in stored if name not in known]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: checkpoint does not match {type(module).__name__}: "
            f"missing {_name_list(missing)}; unexpected {_name_list(unexpected)}"
        )
    return plan


def _assign(module: nn.Module, names: list[str], tensor: torch.Tensor, is_parameter: bool) -> None:
    """Point every alias at `tensor`, replacing (not copying into) the old tensor."""
    value = nn.Parameter(tensor, requires_grad=False) if is_parameter else tensor
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner_name), attr, value)


def _open_safetensors(file: Path, device: torch.device | str = "cpu"):
    try:
        return safe_open(file, framework="pt", device=str(device))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"cannot read safetensors file {file}: {error}") from error


def _read(getter: Callable[[str], _T], file: Path, name: str) -> _T:
    try:
        return getter(name)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"cannot read tensor {name!r} from {file}: {error}") from error


def _name_list(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(sorted(names)[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return f"{shown} (and {more} more)" if more > 0 else shown
