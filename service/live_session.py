"""A live video session: frames in, tubelets prefilled into a held prefix, questions forked off.

The stream is one logical video. Every second frame completes a tubelet: preprocessed as
`preprocess_video` treats the whole clip, encoded by the tower off the event loop, pruned by
threshold-mode EVS (causal, so streamed equals whole) and appended to a prefix the engine holds.
Tubelet k is its own item, written as the family's prompt format writes a stream's tubelets
(`PromptProcessor.stream_input`): either its kept tokens carry t = k and it claims the grid so
far (k + 1, h, w), so the held tokens are those of the whole clip as one video; or (a format
with `separate_tubelets`) it is its own one-tubelet video (t = 0 in a (1, h, w) grid) with its
own text around it, as the processor writes each tubelet of a whole clip. A question forks an
ordinary request: the held tokens, a pending odd frame padded to a tubelet for this answer
only, then `<|vision_end|>` and the question, so only the question is left to prefill.
"""

from __future__ import annotations

import asyncio
import copy
import io
import itertools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from stillcut.engine.admission import RequestTooLong, ResourceExhausted, TooManyVisualTokens
from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.multimodal import MultiModalItem, TowerOutput, select_rows
from stillcut.engine.processor import Prompt
from stillcut.kernels.evs import ThresholdPruner
from stillcut.kernels.evs.result import result_from_mask
from stillcut.service.async_engine import AsyncEngine, EngineStopped
from stillcut.service.live_options import (
    BadFrame,
    LiveLimitExceeded,
    LiveOptions,
    NoFrameYet,
    SessionClosed,
)
from stillcut.vision.pipeline import VisionPipeline, item_identifier, media_key
from stillcut.vision.pixel_stage import check_pixel_stage, merged_grid

FRAME_FORMATS = ("PNG", "JPEG")
Runner = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs blocking work off the event loop
_ENGINE_LIMITS = (RequestTooLong, TooManyVisualTokens, ResourceExhausted)


class LiveSessionsUnsupported(ValueError):
    """The served model serves no live sessions: its registry entry says so (see
    `ModelConfig.live_sessions_refusal`)."""


@dataclass(frozen=True)
class TubeletEvent:
    """A tubelet was encoded, pruned and prefilled: `kept` of its `total` tokens remain."""

    t: float  # timestamp of its first frame, seconds
    tubelet: int
    kept: int
    total: int


@dataclass(frozen=True)
class _Frame:
    timestamp: float
    pixels: np.ndarray  # [H, W, 3] uint8 RGB


class LiveSession:
    """One client's stream over a shared engine; see the module docstring."""

    def __init__(
        self,
        pipeline: VisionPipeline,
        engine: AsyncEngine,
        options: LiveOptions,
        session_id: str,
        *,
        run_encode: Runner = asyncio.to_thread,
        run_prompt: Runner = asyncio.to_thread,
    ) -> None:
        """`run_encode` runs frame decoding and the tower, `run_prompt` tokenizing (a server
        passes its bounded workers)."""
        refusal = pipeline.model_config.live_sessions_refusal
        if refusal is not None:
            raise LiveSessionsUnsupported(
                f"{refusal}; ask about a whole video with POST /v1/videos/describe or "
                "/v1/chat/completions"
            )
        if not engine.engine.scheduler.cache_config.enable_prefix_caching:
            # the held prefix is only ever reused through the prefix cache
            raise ValueError(
                "live sessions need prefix caching, and enable_prefix_caching is off in this "
                "engine's cache config; turn it on to stream"
            )
        check_pixel_stage(pipeline.family, options.evs)
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id={session_id!r} must be a non-empty string")
        self.options = options
        self.session_id = session_id
        self._pipeline = pipeline
        self._engine = engine
        self._run_encode = run_encode
        self._run_prompt = run_prompt
        self._evs = options.evs
        self._held_id = f"{session_id}-held"
        self._lock = asyncio.Lock()  # frames, asks' snapshots and close take turns
        self._processor = engine.engine.processor  # tokenizing is safe beside the engine thread
        self._separate_tubelets = self._processor.family.prompt_format.separate_tubelets
        self._frame_size: tuple[int, int] | None = None  # (height, width) of the first frame
        self._num_frames = 0
        self._last_timestamp = -math.inf
        self._pending: _Frame | None = None  # the first frame of the next tubelet
        self._pruner: ThresholdPruner | None = None  # EVS references of the committed tubelets
        self._nothing: TowerOutput | None = None  # set by the first tubelet (kept whole)
        self._items: list[MultiModalItem] = []  # one per committed tubelet
        self._num_held_items = 0  # the rest are 0-token tubelets the prefix cannot hold yet
        self._chain = ""  # identifier of the stream so far
        self._ask_ids = itertools.count()
        self._closing: asyncio.Task | None = None

    async def add_frame(self, timestamp: float, image: bytes) -> TubeletEvent | None:
        """Take one PNG or JPEG frame; returns the event of the tubelet it completes, if any.

        Raises `BadFrame` or `LiveLimitExceeded` (the session should end) or an engine error.
        """
        async with self._lock:
            self._check_open()
            self._check_frame(timestamp, image)
            max_pixels = self.options.limits.max_frame_pixels
            pixels = await self._run_encode(lambda: decode_frame(image, max_pixels))
            self._check_size(pixels)
            frame = _Frame(timestamp, pixels)
            self._num_frames += 1
            self._last_timestamp = timestamp
            if self._pending is None:
                self._pending = frame
                return None
            first, self._pending = self._pending, None
            frames = np.stack([first.pixels, frame.pixels])  # [2, H, W, 3]
            item, pruner = await self._tubelet(frames, (first.timestamp, timestamp))
            await self._commit(item)
            self._pruner = pruner
            index, total = len(self._items) - 1, item.stats["tokens_total"]
            return TubeletEvent(first.timestamp, index, item.num_tokens, total)

    async def ask(self, prompt: str) -> AsyncIterator[RequestOutput]:
        """Answer `prompt` about the stream so far; the session goes on afterwards."""
        # a bad prompt fails before any work
        question = await self._run_prompt(lambda: self._processor.ask_suffix(prompt))
        async with self._lock:
            self._check_open()
            if not self._items and self._pending is None:
                raise NoFrameYet("ask came before any frame; send a frame first")
            items, pending = list(self._items), self._pending
            if pending is not None:  # padded as preprocessing pads a clip's last tubelet
                trial, _ = await self._tubelet(pending.pixels[None], (pending.timestamp,))
                items.append(trial)
        prefix = self._processor.vision_prefix(items)
        fork = Prompt(prefix.token_ids + question, items, prefix.mm_positions)
        request_id = f"{self.session_id}-ask-{next(self._ask_ids)}"
        stream = self._engine.generate(fork, self.options.sampling, request_id=request_id)
        async with aclosing(stream):  # leaving early closes the stream: the request is aborted
            async for output in stream:
                self._check_open()  # a closed session stops its answers at the next token
                yield output

    async def close(self) -> None:
        """End the session: release its held prefix (answers being read stop at their next
        token). Idempotent; frees the blocks even if the caller is cancelled meanwhile."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._release())
        await asyncio.shield(self._closing)

    # ---- frames --------------------------------------------------------------------------------

    def _check_frame(self, timestamp: float, image: bytes) -> None:
        limits = self.options.limits
        if self._num_frames >= limits.max_frames:
            raise LiveLimitExceeded(
                f"the session already has max_frames={limits.max_frames} frames"
            )
        if len(image) > limits.max_frame_bytes:
            raise LiveLimitExceeded(
                f"a frame of {len(image)} bytes exceeds max_frame_bytes={limits.max_frame_bytes}"
            )
        if not math.isfinite(timestamp) or timestamp < self._last_timestamp:
            raise BadFrame(
                f"timestamp {timestamp!r} must be finite and not before the last frame's "
                f"{self._last_timestamp!r}"
            )

    def _check_size(self, pixels: np.ndarray) -> None:
        height, width, _ = pixels.shape
        if self._frame_size is None:
            try:  # the first frame fixes the resize of the whole stream
                self._pipeline.media.check_video_frame(height, width)
            except ValueError as error:
                raise BadFrame(str(error)) from None
            self._frame_size = (height, width)
        elif (height, width) != self._frame_size:
            first_height, first_width = self._frame_size
            raise BadFrame(
                f"the frame is {width}x{height}; this session's frames are "
                f"{first_width}x{first_height}, fixed by the first frame"
            )

    async def _tubelet(
        self, frames: np.ndarray, timestamps: tuple[float, ...]
    ) -> tuple[MultiModalItem, ThresholdPruner | None]:
        """The next tubelet's item from 1 or 2 frames, and the pruner after it; the session's
        own pruner is left as it was."""
        index = len(self._items)
        pruner = None if self._pruner is None else copy.deepcopy(self._pruner)
        prepared, output, result, pruner = await self._run_encode(
            lambda: self._encode(frames, pruner, index)
        )
        _, height, width = prepared.grid_thw
        coords, grid_t = result.kept_coords, index + 1  # [num_kept, 3], t = index
        if self._separate_tubelets:
            coords, grid_t = coords * coords.new_tensor([0, 1, 1]), 1
        # the identifier chains the stream so far: what EVS kept here depends on all of it
        params = {"kind": "live", "previous": self._chain, "fps": self.options.fps}
        key = media_key(self._pipeline.model_key, frames, params)
        item = MultiModalItem(
            kind="video",
            embeds=output.embeds,  # [num_kept, hidden]
            # extra feature sets (the draft model's among them) at the tokens EVS kept
            features=output.features,
            coords=coords,
            grid_thw=(grid_t, height, width),  # the logical video's grid so far, or its own
            merge_size=self._pipeline.media.merge_size,
            second_per_grid_ts=prepared.second_per_grid_ts,
            timestamps=timestamps,
            media_key=key,
            identifier=item_identifier(key, self._evs),
            kept_per_tubelet=(result.num_kept_tokens,),
            stats={"tokens_total": result.mask.numel(), "tokens_kept": result.num_kept_tokens},
        )
        return item, pruner

    def _encode(self, frames: np.ndarray, pruner: ThresholdPruner | None, index: int):
        """Tubelet `index`'s preprocessed input, its tower output at the tokens EVS kept (the
        embeddings [num_kept, hidden] and extra feature sets, the draft tower's among them),
        what EVS chose and the pruner after it (None while nothing is pruned). EVS before the
        tower decides first and the tower encodes the kept tokens only: a tubelet it empties
        costs no tower pass."""
        media, evs = self._pipeline.media, self._evs
        prepared = media.prepare_video(frames, self.options.fps)
        _, h, w = merged_grid(prepared.grid_thw, media.merge_size)
        if evs.before_tower and evs.keeps_all:
            every = torch.ones(h * w, dtype=torch.bool)
            chosen = result_from_mask(every, torch.zeros(h * w), (h, w), first_t=index)
            return prepared, self._tower(prepared, None), chosen, None
        if evs.before_tower:
            features = media.pixel_features(prepared)  # [h * w, dim]
            pruner = pruner or ThresholdPruner(evs, (h, w), features.shape[1])
            chosen = pruner.push(features)
            if chosen.num_kept_tokens == 0:
                return prepared, self._nothing, chosen, pruner
            return prepared, self._tower(prepared, chosen.mask), chosen, pruner
        output = self._tower(prepared, None)
        embeds = output.embeds  # [h * w, hidden]
        pruner = pruner or ThresholdPruner(
            evs, (h, w), embeds.shape[1], embeds.device, embeds.dtype
        )
        chosen = pruner.push(embeds)
        kept = TowerOutput(
            embeds[chosen.kept_index], select_rows(output.features, chosen.kept_index)
        )
        return prepared, kept, chosen, pruner

    def _tower(self, prepared, kept: torch.Tensor | None) -> TowerOutput:
        """One tower pass over one tubelet (`kept`: the tokens to encode, None: all)."""
        self._pipeline.work.tower_passes += 1
        (output,) = self._pipeline.encode_prepared([prepared], [kept])
        if self._nothing is None:  # the rows of a tubelet EVS empties: none, of these widths
            self._nothing = TowerOutput(output.embeds[:0], select_rows(output.features, slice(0)))
        return output

    # ---- the held prefix -----------------------------------------------------------------------

    async def _commit(self, item: MultiModalItem) -> None:
        """Prefill `item` into the held prefix (first tubelet: create it) and wait until done."""
        new_items = [*self._items[self._num_held_items :], item]
        try:
            if not self._items:
                prefix = self._processor.vision_prefix(new_items)
                stream = self._engine.generate(
                    prefix, self.options.sampling, request_id=self._held_id, hold=True
                )
                async with aclosing(stream):
                    async for _ in stream:
                        pass
                num_held_tokens = len(prefix.token_ids)
            else:
                new_input = self._processor.stream_input(new_items)
                num_held_tokens = len(new_input.token_ids)
                # a held prefix cannot grow by 0 tokens: bare empty tubelets wait for one
                if num_held_tokens:
                    await self._engine.extend_held(self._held_id, new_input)
        except _ENGINE_LIMITS as error:
            raise LiveLimitExceeded(f"the stream is too long for this engine: {error}") from error
        self._items.append(item)
        self._chain = item.identifier
        if num_held_tokens:
            self._num_held_items = len(self._items)

    async def _release(self) -> None:
        async with self._lock:  # a frame being prefilled finishes first
            try:
                await self._engine.abort(self._held_id)  # frees a held prefix in any state
            except EngineStopped:
                pass  # a stopped engine has released every held prefix already

    def _check_open(self) -> None:
        if self._closing is not None:
            raise SessionClosed(f"session {self.session_id!r} is closed")


def decode_frame(data: bytes, max_pixels: int) -> np.ndarray:
    """An upright RGB frame [H, W, 3] uint8 from PNG or JPEG bytes; the pixel count is checked
    from the header, before anything is decoded."""
    try:
        image = Image.open(io.BytesIO(data), formats=FRAME_FORMATS)
    except (UnidentifiedImageError, OSError) as error:
        raise BadFrame(f"the frame is not a PNG or JPEG image ({error})") from None
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise LiveLimitExceeded(
                f"a {width}x{height} frame has {width * height} pixels; "
                f"max_frame_pixels={max_pixels}"
            )
        try:
            return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            raise BadFrame(f"the frame could not be decoded ({error})") from None
