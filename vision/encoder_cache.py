"""The encoder cache: embeddings of media already seen, keyed by `media_key`.

An entry keyed by `media_key` alone holds embeddings and the tower's extra feature sets
(`MultiModalItem.features`) *before* EVS, so re-asking about a video with any setting of EVS
after the tower never runs the encoder again. EVS before the tower (`EVSConfig(stage="pixels")`)
decides what the tower encodes, so its entries are keyed by `media_key` and the EVS setting and
hold only the kept tokens: their embeddings and features, coordinates and per-tubelet counts.
Least recently used entries go first once the byte bound is reached; an entry larger than the
whole bound is not stored at all.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from stillcut.engine.checkpoint import Checkpoint


@dataclass(frozen=True)
class EncodedMedia:
    """One video or image after the tower: every token before pruning, or (`kept_coords` set)
    the tokens EVS before the tower kept, in ascending flat (t, h, w) order."""

    embeds: torch.Tensor  # [t * h/m * w/m, hidden] flat (t, h, w) order, or [num_kept, hidden]
    grid_thw: tuple[int, int, int]  # pre-merge patch grid
    second_per_grid_ts: float
    timestamps: tuple[float, ...]  # seconds, one per sampled frame
    info: dict  # decode facts for reporting (codec, sizes, fps, ...)
    source_indices: tuple[int, ...] = ()  # each sampled frame's index in the source video
    source_fps: float | None = None  # the source's frame rate, when known
    # extra feature sets of the same rows, the draft tower's among them: name -> [rows, width]
    features: Mapping[str, torch.Tensor] = field(default_factory=dict)
    kept_coords: torch.Tensor | None = None  # [num_kept, 3] long (t, h, w), pruned before the tower
    kept_per_tubelet: tuple[int, ...] = ()  # with kept_coords: tokens kept in each tubelet

    @property
    def nbytes(self) -> int:
        tensors = (self.embeds, *self.features.values())
        if self.kept_coords is not None:
            tensors = (*tensors, self.kept_coords)
        return sum(t.numel() * t.element_size() for t in tensors)


class EncoderCache:
    """A thread-safe LRU map `media_key -> EncodedMedia`, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, EncodedMedia] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, media_key: str) -> EncodedMedia | None:
        with self._lock:
            entry = self._entries.get(media_key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(media_key)
            self.hits += 1
            return entry

    def put(self, media_key: str, entry: EncodedMedia) -> None:
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(media_key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            self._entries[media_key] = entry
            self._nbytes += entry.nbytes
            while self._nbytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._nbytes -= evicted.nbytes

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, media_key: str) -> bool:
        return media_key in self._entries

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0


def model_fingerprint(checkpoint: Checkpoint, weight_format: str = "") -> str:
    """Identify a checkpoint cheaply: its config plus the names, sizes and mtimes of weights,
    and the format its weights are stored in (`WeightFormat.describe`)."""
    config = json.dumps(dict(checkpoint.config.raw), sort_keys=True)
    digest = hashlib.sha256(config.encode() + weight_format.encode())
    for weights in sorted(checkpoint.folder.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
