"""CUDA graphs of the vision encoder, one per input shape, and never of EVS.

An encoder pass over a batch of one shape always launches the same kernels, so on CUDA it may
be captured once per shape and replayed: the pass then costs one launch instead of one per
kernel (a ViT of 27 layers launches several hundred), which matters for live streams that
encode one small tubelet at a time. Each shape costs a capture (a warm-up pass plus a captured
one, the first time it is met) and keeps its activations allocated for as long as its graph
lives, so at most `max_shapes` graphs are kept, the least recently used dropped first. The EVS
step after the encoder is never captured: how many tokens it keeps depends on the content, so
its output shape is not known before it runs.

Only towers whose `encode(pixel_values)` is a pure device computation over one input tensor
declare `capturable_per_shape` (a plain ViT on fixed squares); towers that build per-grid
rotary tables or window orders on the host each pass, or whose patch generator is unchecked,
run eagerly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from stillcut.engine.checkpoint import CheckpointLike
from stillcut.engine.quantization import WeightFormat
from stillcut.vision.towers import load_vision_tower

log = logging.getLogger(__name__)

DEFAULT_MAX_SHAPES = 8


def encoder_graphs_unavailable(
    tower: nn.Module, device: torch.device, enforce_eager: bool
) -> str | None:
    """Why the vision encoder runs eagerly; None when it may be captured per shape."""
    if enforce_eager:
        return "enforce_eager is set"
    if not getattr(tower, "capturable_per_shape", False):
        return f"{type(tower).__name__} does host work in each pass"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not on a CUDA device"
    return None


def load_encoder(
    path: CheckpointLike,
    weight_format: WeightFormat,
    device: torch.device,
    enforce_eager: bool,
    max_shapes: int = DEFAULT_MAX_SHAPES,
    role: str = "vision encoder",
) -> nn.Module:
    """A checkpoint's vision encoder, replayed from CUDA graphs per input shape where it may
    be (a `GraphedTower`); the log says which, naming the encoder by its `role`."""
    tower = load_vision_tower(path, weight_format, device=device)
    eager_reason = encoder_graphs_unavailable(tower, device, enforce_eager)
    if eager_reason is not None:
        log.info("%s runs eagerly (%s); so does EVS", role, eager_reason)
        return tower
    log.info(
        "%s: CUDA graphs per input shape (at most %d kept); "
        "EVS runs eagerly after it (its kept count depends on the content)",
        role,
        max_shapes,
    )
    return GraphedTower(tower, max_shapes)


class EncoderGraphs:
    """`encode(pixel_values)` replayed from a captured graph per (shape, dtype)."""

    def __init__(
        self, encode: Callable[[torch.Tensor], torch.Tensor], max_shapes: int = DEFAULT_MAX_SHAPES
    ) -> None:
        if max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes} must be >= 1")
        self.encode = encode
        self.max_shapes = max_shapes
        # (shape, dtype) -> (graph, static input, static output), least recently used first
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]]
        self.graphs = OrderedDict()

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The encoder's output for `pixel_values` (any device), a tensor of its own."""
        key = (tuple(pixel_values.shape), pixel_values.dtype)
        if key not in self.graphs:
            if len(self.graphs) == self.max_shapes:
                self.graphs.popitem(last=False)  # frees that graph's memory
            self.graphs[key] = self._capture(pixel_values)
        self.graphs.move_to_end(key)
        graph, static_input, static_output = self.graphs[key]
        static_input.copy_(pixel_values)
        graph.replay()
        return static_output.clone()  # the next replay overwrites the static output

    def _capture(self, pixel_values: torch.Tensor):
        device = torch.device("cuda", torch.cuda.current_device())
        static_input = pixel_values.to(device, copy=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.encode(static_input)  # warm up outside the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = self.encode(static_input)
        log.info("vision encoder: captured a CUDA graph for input %s", tuple(pixel_values.shape))
        return graph, static_input, static_output


class GraphedTower:
    """A tower whose `encode` replays `EncoderGraphs`; every other attribute is the tower's."""

    def __init__(self, tower: nn.Module, max_shapes: int = DEFAULT_MAX_SHAPES) -> None:
        self.tower = tower
        self.encode = EncoderGraphs(tower.encode, max_shapes)

    def __getattr__(self, name: str):
        return getattr(self.tower, name)
