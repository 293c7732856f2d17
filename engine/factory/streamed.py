"""Random checkpoints too large to build in memory, written tensor by tensor.

A 7B-shaped model is 16.6 GB in bfloat16 and twice that in the float32 transformers initialises
in, more than these machines hold. Here the model is built on the meta device only, for its
parameter names and shapes (a tied head is one tensor, saved once, as `save_pretrained` does),
and the safetensors file is written by hand: the header first, then each tensor's values drawn
straight in the checkpoint's dtype a block at a time, so at most one block ever exists in
memory. Values follow transformers' own init for these models: weights normal(0,
`initializer_range`), biases zero, norms one; seeded, so a spec gives the same file.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

BLOCK_VALUES = 32 << 20  # values drawn (and written) at once
_SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_streamed(model_class, config, generation_config, folder: Path, seed: int, dtype: str):
    """Write `config.json`, `generation_config.json` and `model.safetensors` of a random
    `model_class(config)` in `dtype` into `folder`."""
    stored = getattr(torch, dtype)
    config.dtype = stored  # what the checkpoint says it is stored in
    config.save_pretrained(folder)
    generation_config.save_pretrained(folder)
    with torch.device("meta"):
        model = model_class(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: once
    std = getattr(config, "initializer_range", None) or config.get_text_config().initializer_range
    generator = torch.Generator().manual_seed(seed)
    with open(folder / "model.safetensors", "wb") as file:
        file.write(_header(shapes, stored))
        for name, shape in shapes.items():
            for block in _values(name, shape, stored, std, generator):
                file.write(block.view(torch.uint8).numpy().data)


def _header(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> bytes:
    """The safetensors header: its length (8 bytes, little-endian), then JSON padded with
    spaces to a multiple of 8 bytes, tensors in `shapes`' order, back to back."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * dtype.itemsize
        entries[name] = {
            "dtype": _SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(entries, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _values(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, std: float, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Tensor `name`'s values, flat, in blocks of at most `BLOCK_VALUES`."""
    count = math.prod(shape)
    for start in range(0, count, BLOCK_VALUES):
        block = torch.empty(min(BLOCK_VALUES, count - start), dtype=dtype)
        if name.endswith("bias"):
            yield block.zero_()
        elif len(shape) == 1:
            yield block.fill_(1.0)  # a norm's scale
        else:
            yield block.normal_(0.0, std, generator=generator)
