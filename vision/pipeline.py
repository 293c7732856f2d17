"""From a video (path, bytes, file object or frame array) to a `MultiModalItem`.

decode → preprocess → tower → EVS. The encoder cache sits between the tower and EVS, keyed by
`media_key` (the model, the media bytes and every decode/preprocess parameter), so changing
the settings of EVS after the tower never re-runs the encoder. EVS before the tower
(`EVSConfig(stage="pixels")`, `pixel_stage`) decides from the preprocessed pixels which tokens
the tower encodes: its entries are keyed by `media_key` plus the EVS setting and hold the kept
tokens only. The item's `identifier` adds the EVS setting; that is what the prefix cache
hashes. Several media asked for together are encoded in one tower pass (inputs pruned before the
tower among others); a video file longer than one window streams through the tower a window at
a time instead (`video_windows`), holding only a window plus what it keeps. What differs by
family is read off its registry entry: the tower, the media class that preprocesses frames and
encodes batches (tubelet patches merged 2x2, or one square per frame), and whether its items
attend bidirectionally. A tower may give extra feature sets beside the embeddings (a media class's
`encode` returns `TowerOutput`s); the encoder cache holds them before EVS and each item carries
them at exactly the tokens EVS kept (`MultiModalItem.features`). With a `draft_model` (the
engine speculates with a draft model) the draft's own tower encodes the same preprocessed input
in the same pass, and its output joins the item's features the same way (`DRAFT`); the encoder
cache then keys and holds both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image

from stillcut.engine.checkpoint import open_checkpoint
from stillcut.engine.loader import checkpoint_dtype
from stillcut.engine.multimodal import MultiModalItem, TowerOutput, dense_coords, select_rows
from stillcut.engine.quantization import WeightFormat
from stillcut.kernels.evs import EVSConfig, EVSResult, prune
from stillcut.kernels.evs.clip_pruner import ClipKept
from stillcut.vision.decode_config import DecodeConfig
from stillcut.vision.draft_tower import DraftTower
from stillcut.vision.encoder_cache import EncodedMedia, EncoderCache, model_fingerprint
from stillcut.vision.encoder_graphs import DEFAULT_MAX_SHAPES, load_encoder
from stillcut.vision.errors import VideoTooLarge
from stillcut.vision.image_file import decode_image
from stillcut.vision.pixel_stage import check_pixel_stage, merged_grid, pixel_evs, prune_pixels
from stillcut.vision.work import VisionWork

log = logging.getLogger(__name__)
VideoSource = str | os.PathLike | bytes | BinaryIO | np.ndarray
ImageSource = str | os.PathLike | bytes | BinaryIO | np.ndarray | Image.Image
_HASH_CHUNK = 1 << 20
# sources that can be read again (a file object is read once)
_REREADABLE = (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, Image.Image)


@dataclass(frozen=True)
class VideoInput:
    """One video to encode, with its per-request decode options.

    A frame array `[T, H, W, 3]` uint8 is taken as already sampled at `frames_fps`
    (its timestamps default to `k / frames_fps`); files are sampled at `fps` over
    [start, end) with at most `max_frames` frames, or exactly `num_frames` evenly (None: the
    pipeline's decode defaults). `pixels` is a pixel budget as (name, value) pairs, the names
    the family's entry takes (`ModelFamily.pixel_budget`, such as min_pixels, max_pixels).
    `resize` is "exact" or "fast" (`DecodeConfig.resize`; None: the pipeline's).
    """

    source: VideoSource
    evs: EVSConfig | None = None
    start: float | None = None
    end: float | None = None
    fps: float | None = None
    max_frames: int | None = None
    frames_fps: float = 2.0
    timestamps: tuple[float, ...] | None = None
    num_frames: int | None = None
    pixels: tuple[tuple[str, int], ...] = ()
    resize: str | None = None


@dataclass(frozen=True)
class ImageInput:
    """One image to encode (a tubelet of one frame; never pruned)."""

    source: ImageSource


class VisionPipeline:
    """The vision half of a checkpoint: tower, preprocessing, encoder cache and EVS.

    On CUDA a tower that allows it is replayed from a CUDA graph per input shape (at most
    `max_graph_shapes` kept, see `encoder_graphs`) unless `enforce_eager`; EVS always runs
    eagerly. The log says which at construction. `draft_model` is the checkpoint the engine
    drafts with (`SpeculativeConfig.draft_model`), or None; its tower loads in the same
    weight format and is checked against the target as the engine checks the draft
    (`check_draft`: tokenizer, preprocessing, patch grid and merge).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        weight_format: WeightFormat = WeightFormat(),
        device: torch.device | str = "cpu",
        decode_config: DecodeConfig = DecodeConfig(),
        cache_bytes: int = 1 << 30,
        enforce_eager: bool = False,
        max_graph_shapes: int = DEFAULT_MAX_SHAPES,
        draft_model: str | os.PathLike | None = None,
        window_frames: int = 32,
    ) -> None:
        if not (isinstance(window_frames, int) and window_frames >= 2 and window_frames % 2 == 0):
            raise ValueError(f"window_frames must be an even integer >= 2, got {window_frames!r}")
        self.window_frames = window_frames
        checkpoint = open_checkpoint(model)
        self.path = checkpoint.folder
        self.model_config = checkpoint.config
        self.family = self.model_config.family
        self.weight_format = weight_format.resolved(checkpoint_dtype(checkpoint))
        self.device = torch.device(device)
        graphs = (enforce_eager, max_graph_shapes)
        self.tower = load_encoder(checkpoint, self.weight_format, self.device, *graphs)
        self.media = self.family.media_class()(self.path, self.model_config)
        self.draft = None
        if draft_model is not None:
            self.draft = DraftTower.load(
                self.path, self.model_config, draft_model, weight_format, self.device, *graphs
            )
        self.video_preprocess = self.media.video_preprocess
        self.image_preprocess = self.media.image_preprocess
        self.decode_config = decode_config
        self.cache = EncoderCache(cache_bytes)
        # the weights as stored shape the embeddings: a format is part of the model's identity
        self.model_key = model_fingerprint(checkpoint, self.weight_format.embedding_key())
        self.work = VisionWork()

    def encode_prepared(
        self, prepared: list, kept: list[torch.Tensor | None] | None = None
    ) -> list[TowerOutput]:
        """Encode preprocessed inputs (the media class's), all in one pass of the tower (and
        one of the draft's): each input's dense embeddings [tokens, hidden] and extra feature
        sets, the draft tower's output among them (`TowerOutput.with_draft`). `kept` (EVS
        before the tower) gives per input a [tokens] bool mask of the tokens to encode, or None
        (all); both towers then give the kept tokens only."""
        masks = () if kept is None or all(mask is None for mask in kept) else (kept,)
        with torch.inference_mode():
            # EVS and the language model read them in the activations' dtype (float32 on
            # CPU, whatever the tower's arithmetic): EVS's dissimilarities are not rounded
            dtype = self.weight_format.compute_dtype
            outputs = [
                TowerOutput.of(o).to(dtype)
                for o in self.media.encode(self.tower, prepared, self.device, *masks)
            ]
            if self.draft is None:
                return outputs
            drafts = self.draft.encode(prepared, self.device, *masks)
        return [
            ours.with_draft(TowerOutput.of(theirs).to(dtype))
            for ours, theirs in zip(outputs, drafts, strict=True)
        ]

    def _cache_key(self, media_key: str, evs: EVSConfig | None = None) -> str:
        """The encoder cache's key: EVS before the tower (`evs`, from `pixel_evs`) keeps only
        some tokens, and with a draft entries hold its embeddings too, so they are told apart
        from entries of the same media without them."""
        parts = [media_key]
        if evs is not None:
            parts.append(evs.key())
        if self.draft is not None:
            parts.append(f"draft:{self.draft.key}")
        if len(parts) == 1:
            return media_key
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def video(self, source: VideoSource, evs: EVSConfig | None = None, **options) -> MultiModalItem:
        """Encode one video (see `VideoInput` for the options)."""
        return self.encode([VideoInput(source, evs=evs, **options)])[0]

    def image(self, source: ImageSource) -> MultiModalItem:
        """Encode one image."""
        return self.encode([ImageInput(source)])[0]

    def cached(self, media_key: str) -> EncodedMedia | None:
        """The encoder cache's entry for `media_key` (None: not held)."""
        return self.cache.get(self._cache_key(media_key))

    def store(self, media_key: str, encoded: EncodedMedia) -> None:
        """Hold `encoded` in the encoder cache under `media_key`."""
        self.cache.put(self._cache_key(media_key), encoded)

    def item_of(
        self,
        media_key: str,
        encoded: EncodedMedia,
        evs: EVSConfig | None,
        timings: dict[str, float] | None = None,
    ) -> MultiModalItem:
        """The video item of `encoded` (a clip through the tower, before EVS) known by
        `media_key`, pruned by `evs`; `timings` are the seconds its decoding and encoding
        took (None: it came from the encoder cache)."""
        entry = _Loaded(media_key, self._cache_key(media_key), encoded)
        entry.cache_hit = timings is None
        entry.timings = dict(timings or {})
        spec = VideoInput(b"", evs=evs)
        return entry.to_item(spec, self.media.merge_size, self.family.bidirectional_items)

    def encode(self, inputs: list[VideoInput | ImageInput]) -> list[MultiModalItem]:
        """Encode several media in order; cache misses share one tower pass."""
        loaded = [self._load(spec) for spec in inputs]
        for entry in loaded:
            if entry.streamed and entry.kept is None:
                self.cache.put(entry.cache_key, entry.encoded)
        misses = [entry for entry in loaded if entry.encoded is None]
        if misses:
            started = time.perf_counter()
            self.work.tower_passes += 1
            outputs = self.encode_prepared(
                [entry.prepared for entry in misses], [entry.kept_mask for entry in misses]
            )
            encode_s = time.perf_counter() - started
            for entry, output in zip(misses, outputs, strict=True):
                entry.finish(own_tensors(output, len(misses)), encode_s=encode_s)
                self.cache.put(entry.cache_key, entry.encoded)
        return self._items(loaded, inputs)

    def encode_cached(self, inputs: list[VideoInput | ImageInput]) -> list[MultiModalItem] | None:
        """What `encode(inputs)` returns when every input is in the encoder cache, else None.
        Only hashing and EVS run (no decoding, no tower), so it may run beside an `encode` in
        progress. File objects, which can be read only once, are left to `encode`."""
        if any(not isinstance(spec.source, _REREADABLE) for spec in inputs):
            return None
        for spec in inputs:
            check_pixel_stage(self.family, _evs_of(spec))
        keys = [(self._key(spec)[0], pixel_evs(_evs_of(spec))) for spec in inputs]
        if not all(self._cache_key(*key) in self.cache for key in keys):
            return None
        loaded = [
            _Loaded(key, self._cache_key(key, evs), self.cache.get(self._cache_key(key, evs)))
            for key, evs in keys
        ]
        if any(entry.encoded is None for entry in loaded):  # evicted since the check
            return None
        return self._items(loaded, inputs)

    def _items(
        self, loaded: list[_Loaded], inputs: list[VideoInput | ImageInput]
    ) -> list[MultiModalItem]:
        return [
            entry.to_item(spec, self.media.merge_size, self.family.bidirectional_items)
            for entry, spec in zip(loaded, inputs, strict=True)
        ]

    def _load(self, spec: VideoInput | ImageInput) -> _Loaded:
        check_pixel_stage(self.family, _evs_of(spec))
        key, prepare_from = self._key(spec)
        cache_key = self._cache_key(key, pixel_evs(_evs_of(spec)))
        entry = _Loaded(key, cache_key, self.cache.get(cache_key))
        if entry.encoded is None:
            entry.prepare(self, spec, prepare_from)
        return entry

    def _key(self, spec: VideoInput | ImageInput) -> tuple[str, object]:
        """The input's `media_key`, and what it is decoded from (its bytes, or its path)."""
        spec_source = None
        if isinstance(spec, ImageInput):
            data = _image_payload(spec.source)
            params = {"kind": "image", "preprocess": self.image_preprocess.key()}
        elif isinstance(spec.source, np.ndarray):
            data = _frames_payload(spec.source, spec.frames_fps, spec.timestamps)
            params = {
                "kind": "frames",
                # the frame rate and times set the temporal positions, so they are part of it
                "frames_fps": spec.frames_fps,
                "timestamps": spec.timestamps,
                "preprocess": self._video_preprocess_key(spec),
            }
        else:
            data, spec_source = video_payload(spec.source, self.decode_config.max_bytes)
            params = {
                "kind": "video",
                "decode": self.decode_options(spec).__repr__(),
                "start": spec.start,
                "end": spec.end,
                "preprocess": self._video_preprocess_key(spec),
            }
        key = media_key(self.model_key, data, params)
        return key, spec_source if params["kind"] == "video" else data

    def _video_preprocess_key(self, spec: VideoInput) -> str:
        if spec.pixels:  # the budget in force: a family may keep part of it beside the config
            media = self.media_with(spec.pixels)
            return f"{media.video_preprocess.key()} {sorted(media.pixel_budget().items())}"
        return self.video_preprocess.key()

    def media_with(self, pixels: tuple[tuple[str, int], ...]):
        """The family's media object with a video pixel budget (checked by the entry;
        ValueError names what is wrong)."""
        return self.family.with_pixel_budget(self.media, dict(pixels)) if pixels else self.media

    def decode_options(self, spec: VideoInput) -> DecodeConfig:
        """The decode settings `spec` is sampled and resized with."""
        config = self.decode_config.with_sampling(spec.fps, spec.max_frames, spec.num_frames)
        return config if spec.resize is None else dataclasses.replace(config, resize=spec.resize)


def _evs_of(spec: VideoInput | ImageInput) -> EVSConfig | None:
    return spec.evs if isinstance(spec, VideoInput) else None


class _Loaded:
    """One input on its way through the pipeline: either a cache hit or prepared patches."""

    def __init__(self, media_key: str, cache_key: str, encoded: EncodedMedia | None) -> None:
        self.media_key = media_key
        self.cache_key = cache_key
        self.encoded = encoded
        self.cache_hit = encoded is not None
        self.prepared = None  # the media class's preprocessed input
        self.timings: dict[str, float] = {}
        self._timestamps: tuple[float, ...] = ()
        self._info: dict = {}
        self._source: tuple[tuple[int, ...], float | None] = ((), None)  # frame indices, fps
        self.streamed = False  # encoded window by window (a clip longer than one window)
        self.kept: ClipKept | None = None  # what EVS kept, when the dense clip was not held
        self.pixel_kept: EVSResult | None = None  # what EVS before the tower keeps of `prepared`

    def prepare(self, pipeline: VisionPipeline, spec: VideoInput | ImageInput, data) -> None:
        """Preprocess an image, a frame array or a video file of one window (all encoded in one
        tower pass with the other inputs); a longer video file streams through the tower
        here, window by window (`video_windows`)."""
        if isinstance(spec, VideoInput) and not isinstance(spec.source, np.ndarray):
            self._prepare_file(pipeline, spec, data)
        else:
            self._prepare_media(pipeline, spec, data)
        evs = pixel_evs(_evs_of(spec))
        if evs is not None and self.prepared is not None:
            started = time.perf_counter()
            self.pixel_kept = prune_pixels(pipeline.media, self.prepared, evs)
            self.timings["evs_s"] = time.perf_counter() - started

    @property
    def kept_mask(self) -> torch.Tensor | None:
        """The tokens of `prepared` the tower encodes (None: all)."""
        kept = self.pixel_kept
        return None if kept is None or bool(kept.mask.all()) else kept.mask

    def _prepare_file(self, pipeline: VisionPipeline, spec: VideoInput, data) -> None:
        # PyAV only for files: frame arrays encode where it is not installed (a GPU box)
        from stillcut.vision.decode import open_video
        from stillcut.vision.video_windows import encode_windows

        config = pipeline.decode_options(spec)
        media = pipeline.media_with(spec.pixels)
        started = time.perf_counter()

        def reopen():
            return open_video(data, config, start=spec.start, end=spec.end)

        with reopen() as reader:
            probe = reader.probe
            resize = media.frame_resize
            if resize is not None and config.resize == "fast":
                resize = dataclasses.replace(resize, fast=True)
            if probe.num_samples > pipeline.window_frames:
                windowed = encode_windows(pipeline, media, reader, spec.evs, resize, reopen)
            else:
                decoded = reader.decode(resize=resize, work=pipeline.work)
        self._info = {
            "codec": probe.codec,
            "source_fps": probe.source_fps,
            "sample_fps": probe.sample_fps,
            "duration": probe.duration,
            "start": probe.start,
            "end": probe.start + probe.duration,
            "num_seeks": probe.num_seeks,
            "resize": "fast" if resize is not None and resize.fast else "exact",
            **({"pixel_budget": media.pixel_budget()} if spec.pixels else {}),
        }
        if probe.num_samples <= pipeline.window_frames:
            self._set_frames(decoded.timestamps, decoded.source_fps)
            self._info.update(width=decoded.width, height=decoded.height)
            decoded_s = time.perf_counter()
            told = {} if resize is None else resize.prepare_options((decoded.height, decoded.width))
            self.prepared = media.prepare_video(decoded.frames, decoded.sample_fps, **told)
            self._set_prepared(started, decoded_s)
            return
        self.streamed = True
        self.timings = windowed.timings
        self._set_frames(windowed.timestamps, probe.source_fps)
        height, width = windowed.display_size
        self._info.update(
            width=width,
            height=height,
            resized_width=windowed.resized_size[1],
            resized_height=windowed.resized_size[0],
        )
        if pixel_evs(spec.evs) is None:
            self.kept = windowed.kept
            self.encoded = self._encoded(
                windowed.output, windowed.grid_thw, windowed.second_per_grid_ts
            )
        else:  # pruned before the tower: the kept tokens are what the cache holds
            kept = (windowed.kept.kept_coords, windowed.kept.kept_per_tubelet)
            self.encoded = self._encoded(
                windowed.output, windowed.grid_thw, windowed.second_per_grid_ts, kept
            )

    def _set_frames(self, timestamps, source_fps: float | None) -> None:
        from stillcut.vision.decode import source_indices

        self._timestamps = tuple(timestamps)
        self._source = (source_indices(timestamps, source_fps), source_fps)

    def _set_prepared(self, started: float, decoded_s: float) -> None:
        done = time.perf_counter()
        self.timings = {"decode_s": decoded_s - started, "preprocess_s": done - decoded_s}
        self._info.update(
            resized_width=self.prepared.resized_width, resized_height=self.prepared.resized_height
        )

    def _prepare_media(self, pipeline: VisionPipeline, spec, data) -> None:
        started = time.perf_counter()
        if isinstance(spec, ImageInput):
            frame = _open_image(data, pipeline)
            self._timestamps, self._info = (
                (0.0,),
                {"width": frame.shape[1], "height": frame.shape[0]},
            )
            decoded_s = time.perf_counter()
            self.prepared = pipeline.media.prepare_image(frame)
        else:  # a frame array (files stream through `stream`)
            frames, fps = spec.source, spec.frames_fps
            self._timestamps = spec.timestamps or tuple(k / fps for k in range(len(frames)))
            self._info = {"width": frames.shape[2], "height": frames.shape[1], "sample_fps": fps}
            self._source = (tuple(round(t * fps) for t in self._timestamps), fps)
            decoded_s = time.perf_counter()
            self.prepared = pipeline.media.prepare_video(frames, fps)
        self._set_prepared(started, decoded_s)

    def finish(self, output: TowerOutput, *, encode_s: float) -> None:
        prepared, pixel = self.prepared, self.pixel_kept
        self.timings["encode_s"] = encode_s
        kept = None if pixel is None else (pixel.kept_coords, pixel.kept_per_tubelet)
        self.encoded = self._encoded(output, prepared.grid_thw, prepared.second_per_grid_ts, kept)

    def _encoded(
        self,
        output: TowerOutput,
        grid_thw: tuple[int, int, int],
        second_per_grid_ts: float,
        kept: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> EncodedMedia:
        """The entry of `output`; `kept` (pruned before the tower): the kept tokens'
        coordinates [num_kept, 3] and counts per tubelet [num_tubelets]."""
        source_indices, source_fps = self._source
        return EncodedMedia(
            output.embeds,
            grid_thw,
            second_per_grid_ts,
            self._timestamps,
            self._info,
            source_indices=source_indices,
            source_fps=source_fps,
            features=output.features,
            kept_coords=None if kept is None else kept[0],
            kept_per_tubelet=() if kept is None else tuple(kept[1].tolist()),
        )

    def to_item(
        self, spec: VideoInput | ImageInput, merge: int, bidirectional: bool
    ) -> MultiModalItem:
        encoded = self.encoded
        grid = merged_grid(encoded.grid_thw, merge)
        evs = _evs_of(spec)
        started = time.perf_counter()
        embeds, features = encoded.embeds, encoded.features
        if encoded.kept_coords is not None:  # pruned before the tower
            coords, kept_per_tubelet = encoded.kept_coords, encoded.kept_per_tubelet
        elif self.kept is not None:  # pruned window by window already
            coords = self.kept.kept_coords
            kept_per_tubelet = tuple(self.kept.kept_per_tubelet.tolist())
        elif evs is None or evs.is_off or evs.before_tower:  # before the tower: it kept all
            coords = dense_coords(*grid)
            kept_per_tubelet = (grid[1] * grid[2],) * grid[0]
        else:
            # the target's embeddings decide; every feature set keeps the same tokens, in order
            result = prune(embeds, grid, evs)
            embeds, coords = embeds[result.kept_index], result.kept_coords
            features = select_rows(features, result.kept_index)
            kept_per_tubelet = tuple(result.kept_per_tubelet.tolist())
        stats = {
            **self.timings,
            "evs_s": self.timings.get("evs_s", 0.0) + time.perf_counter() - started,
            "cache_hit": self.cache_hit,
            "num_frames": len(encoded.timestamps),
            "tokens_total": grid[0] * grid[1] * grid[2],
            "tokens_kept": int(embeds.shape[0]),
            **encoded.info,
        }
        return MultiModalItem(
            kind="image" if isinstance(spec, ImageInput) else "video",
            embeds=embeds,
            coords=coords,
            grid_thw=encoded.grid_thw,
            merge_size=merge,
            second_per_grid_ts=encoded.second_per_grid_ts,
            timestamps=encoded.timestamps,
            source_indices=encoded.source_indices,
            source_fps=encoded.source_fps,
            media_key=self.media_key,
            identifier=item_identifier(self.media_key, evs),
            bidirectional=bidirectional,
            kept_per_tubelet=kept_per_tubelet,
            stats=stats,
            features=features,
        )


def own_tensors(output: TowerOutput, batch_size: int) -> TowerOutput:
    """An input's tensors as tensors of their own when they are views of a batch's (a cached
    view would pin the whole batch)."""
    if batch_size == 1:
        return output
    features = {name: tensor.clone() for name, tensor in output.features.items()}
    return TowerOutput(output.embeds.clone(), features)


def media_key(model_key: str, data: bytes | np.ndarray, params: dict) -> str:
    """sha256 of the model, the media content and every decode/preprocess parameter."""
    digest = hashlib.sha256()
    digest.update(b"stillcut-media-v1\0" + model_key.encode() + b"\0")
    digest.update(json.dumps(params, sort_keys=True, default=repr).encode() + b"\0")
    if isinstance(data, np.ndarray):
        digest.update(f"{data.dtype}{data.shape}".encode())
        data = np.ascontiguousarray(data).data
    digest.update(data)
    return digest.hexdigest()


def item_identifier(media_key: str, evs: EVSConfig | None) -> str:
    """The prefix-cache identity of an item: its media plus the pruning applied to it."""
    setting = "evs:off" if evs is None or evs.is_off else evs.key()
    return hashlib.sha256(f"{media_key}\0{setting}".encode()).hexdigest()


def video_payload(source: VideoSource, max_bytes: int) -> tuple[bytes, VideoSource]:
    """The content digest of a video and what to decode it from.

    Paths are hashed in chunks and decoded from disk; file objects are read once into memory.
    """
    if isinstance(source, str | os.PathLike):
        size = os.path.getsize(source)
        if size > max_bytes:
            raise VideoTooLarge(f"the file has {size} bytes; max_bytes={max_bytes}")
        digest = hashlib.sha256()
        with open(source, "rb") as file:
            while chunk := file.read(_HASH_CHUNK):
                digest.update(chunk)
        return digest.digest(), source
    data = (
        bytes(source)
        if isinstance(source, bytes | bytearray | memoryview)
        else source.read(max_bytes + 1)
    )
    if len(data) > max_bytes:
        raise VideoTooLarge(f"the input has more than {max_bytes} bytes (max_bytes={max_bytes})")
    return hashlib.sha256(data).digest(), data


def _frames_payload(
    frames: np.ndarray, fps: float, timestamps: tuple[float, ...] | None
) -> np.ndarray:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ValueError(
            f"a frame array must be [T, H, W, 3] uint8 with T >= 1, got "
            f"{list(frames.shape)} {frames.dtype}"
        )
    if not (fps > 0):
        raise ValueError(f"frames_fps={fps!r} must be > 0")
    if timestamps is not None and len(timestamps) != len(frames):
        raise ValueError(f"{len(timestamps)} timestamps given for {len(frames)} frames")
    return frames


def _image_payload(source: ImageSource) -> bytes | np.ndarray:
    if isinstance(source, Image.Image):
        return np.asarray(source.convert("RGB"))
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[-1] != 3:
            raise ValueError(f"an image array must be [H, W, 3] uint8, got {list(source.shape)}")
        return source
    if isinstance(source, str | os.PathLike):
        return Path(source).read_bytes()
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source)
    return source.read()


def _open_image(data: bytes | np.ndarray, pipeline: VisionPipeline) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    return decode_image(data, pipeline.decode_config.max_image_pixels, pipeline.work)
