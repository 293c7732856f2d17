"""Backend choice and input checks shared by the EVS entry points.

`auto` runs Triton on CUDA tensors and torch elsewhere; `torch` and `triton` force one (tests
force `triton` on CPU under TRITON_INTERPRET=1). Triton is imported only when it is chosen, so
this package imports where triton is absent; `auto` then falls back to torch.
"""

from __future__ import annotations

import operator
from types import ModuleType
from typing import Literal

import torch

from stillcut.kernels.evs.reference import SUPPORTED_DTYPES, pair_dissimilarity_torch

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


def triton_kernels(backend: Backend, device: torch.device) -> ModuleType | None:
    """The Triton kernel module when `backend` picks Triton for `device`, else None."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return None
    try:
        from stillcut.kernels.evs import triton_kernels as kernels
    except ImportError:
        if backend == "triton":
            raise
        return None
    return kernels


def pair_dissimilarity(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, backend: Backend = "auto"
) -> torch.Tensor:
    """Row-wise `1 - cos(a[i], b[i])` in float32 on the chosen backend."""
    kernels = triton_kernels(backend, a.device)
    if kernels is None:
        return pair_dissimilarity_torch(a, b, out)
    return kernels.pair_dissimilarity_triton(a, b, out)


def check_embeds(embeds: torch.Tensor, tokens_per_tubelet: int, dim: int | None = None) -> int:
    """Validate `[num_tubelets * tokens_per_tubelet, dim]` embeddings; return num_tubelets."""
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2:
        shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds)
        raise ValueError(f"embeds must be a 2-D tensor [tokens, dim], got {shape}")
    if embeds.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"embeds dtype {embeds.dtype} is not one of {SUPPORTED_DTYPES}")
    num_tokens, embed_dim = embeds.shape
    if dim is not None and embed_dim != dim:
        raise ValueError(f"embeds dim {embed_dim} does not match dim={dim}")
    if num_tokens == 0 or num_tokens % tokens_per_tubelet != 0:
        raise ValueError(
            f"embeds has {num_tokens} tokens; expected a positive multiple of "
            f"h*w={tokens_per_tubelet}"
        )
    return num_tokens // tokens_per_tubelet


def check_grid(grid: tuple[int, ...], length: int, name: str) -> tuple[int, ...]:
    """Validate `length` positive integer sizes and return them as Python ints."""
    try:
        sizes = tuple(operator.index(size) for size in grid)
    except TypeError:
        sizes = ()
    if len(sizes) != length or min(sizes) < 1:
        raise ValueError(f"{name}={grid!r} must be {length} integers >= 1")
    return sizes
