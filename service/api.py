"""The Python API: `VideoLLM` loads a model once; `describe_video` asks about one video.

A `VideoLLM` is the vision pipeline (decode, encoder, EVS) plus the language engine of one
checkpoint. Used directly, `describe` encodes the video, builds the prompt and steps the engine
on the calling thread; the server instead hands the engine to an `AsyncEngine` (`start_async`)
and calls only `encode` from its encode worker. The pipeline and the engine are not
thread-safe, so each sits behind its own lock. `describe_video` keeps one `VideoLLM` per model.

Without an `evs` of its own, a description prunes with the `VideoLLM`'s default: what it was
built with (`evs=`), else the checkpoint's own pruning rate, else rate 0.75 (`evs_default`).
`summarize` and `summarize_video` take a video longer than one context: captions of its chunks
with their times, then a summary, and answers to questions about when things happen
(`vision.summary`, run here by `summary_api`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import TypeVar

from stillcut.engine.config import CacheConfig, EngineConfig
from stillcut.engine.llm_engine import LLMEngine, RequestOutput
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.processor import DEFAULT_NARRATE_PROMPT, Prompt
from stillcut.engine.quantization import stored_bytes
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.service.async_engine import AsyncEngine
from stillcut.service.evs_default import DEFAULT_EVS, UNSET, EVSChoice, resolve_evs_default
from stillcut.service.media_budget import (
    MediaBudget,
    check_encoded,
    check_media_budget,
    media_identity,
)
from stillcut.service.narrate_api import Frames, Segment, file_frames, for_file, narrate_frames
from stillcut.service.narrate_options import NarrateOptions
from stillcut.service.progress import TokenBar, run_with_bar
from stillcut.service.result import DescribeResult, describe_result
from stillcut.service.summary_api import summarize_here
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.pipeline import ImageInput, VideoInput, VideoSource, VisionPipeline
from stillcut.vision.pixel_stage import check_pixel_stage
from stillcut.vision.summary.result import VideoSummary
from stillcut.vision.summary.when import TemporalAnswer
from stillcut.vision.video_plan import PlanLimits, VideoPlan, plan_video

__all__ = ["DEFAULT_EVS", "DEFAULT_PROMPT", "VideoLLM", "describe_video", "summarize_video"]
DEFAULT_PROMPT = "Describe this video."
DEFAULT_MAX_TOKENS = 256
DEFAULT_KV_CACHE_BYTES = 256 * 2**20
# A bounded KV pool: the engine's own default takes half the free memory, too much for a tool.
DEFAULT_ENGINE_CONFIG = EngineConfig(cache=CacheConfig(kv_cache_memory=DEFAULT_KV_CACHE_BYTES))
DEMO_MODEL_NAME = "stillcut-demo"
PRECISION_OPTIONS = (
    "dtype",
    "quantization",
    "quantization_skip",
    "kv_cache_dtype",
    "compute_dtype",
)
log = logging.getLogger(__name__)
T = TypeVar("T")


def with_precision(config: EngineConfig, **precision) -> EngineConfig:
    """`config` with the given `PRECISION_OPTIONS` (those not None) replaced."""
    unknown = set(precision) - set(PRECISION_OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown options {sorted(unknown)}; precision options: {PRECISION_OPTIONS}"
        )
    given = {key: value for key, value in precision.items() if value is not None}
    if "quantization_skip" in given:
        given["quantization_skip"] = tuple(given["quantization_skip"])
    return replace(config, **given)


def _draft_model(config: EngineConfig) -> str | None:
    """The draft checkpoint whose own tower must encode media too, when the engine drafts
    with one (its drafts for image and video prompts need the draft's embeddings)."""
    speculative = config.speculative
    if speculative is None or speculative.method != "draft":
        return None
    return speculative.draft_model


class VideoLLM:
    """The model loaded once: vision pipeline + engine (+ AsyncEngine for the server)."""

    def __init__(
        self,
        model: str | PathLike | None = None,
        *,
        engine_config: EngineConfig = DEFAULT_ENGINE_CONFIG,
        decode_config: DecodeConfig = DecodeConfig(),
        encoder_cache_bytes: int = 1 << 30,
        name: str | None = None,
        evs: EVSChoice = UNSET,
        **precision,
    ) -> None:
        """`model` is a checkpoint folder or hub id; None is the trained demo checkpoint shipped
        with the package. `name` is the id the server reports (default: the folder name). `evs`
        is the EVS setting of requests that name none (None: off; default: the checkpoint's own
        rate, else rate 0.75; `EVSConfig(stage="pixels")` prunes before the vision tower, where
        the family allows it). `precision` overrides `engine_config`'s `dtype`,
        `quantization`, `quantization_skip`, `kv_cache_dtype` and `compute_dtype` (see
        `EngineConfig`); the vision tower stores its weights in the same format and computes
        in the same arithmetic. With a draft model
        (`engine_config.speculative`), the pipeline encodes media with its tower too."""
        from stillcut.demo import demo_checkpoint

        engine_config = with_precision(engine_config, **precision)
        self.engine = LLMEngine(demo_checkpoint() if model is None else model, engine_config)
        self.path: Path = self.engine.path
        self.pipeline = VisionPipeline(
            self.engine.checkpoint,
            weight_format=self.engine.weight_format,
            device=engine_config.device,
            decode_config=decode_config,
            cache_bytes=encoder_cache_bytes,
            enforce_eager=engine_config.enforce_eager,
            draft_model=_draft_model(engine_config),
        )
        self.vision_weight_bytes = stored_bytes(self.pipeline.tower)
        log.info("vision tower weights: %.1f MiB", self.vision_weight_bytes / 2**20)
        self.processor = self.engine.processor
        self.evs_default = resolve_evs_default(self.engine.model_config, evs)
        check_pixel_stage(self.engine.model_config.family, self.evs_default.evs)
        self.is_random_demo = bool(self.engine.model_config.raw.get("stillcut_random_weights"))
        self.name = name or (DEMO_MODEL_NAME if model is None else _model_name(model))
        self._vision_lock = threading.Lock()
        self._engine_lock = threading.Lock()
        self._async_engine: AsyncEngine | None = None

    def encode(
        self, inputs: Sequence[VideoInput | ImageInput], *, budget: MediaBudget | None = None
    ) -> list[MultiModalItem]:
        """Decode, encode and prune media (thread-safe; one pipeline call at a time). Repeats
        of one input are decoded and encoded once. With a `budget`, what the media will cost
        is worked out from their headers first, and media over it are refused before a frame
        is decoded (the engine's `TooManyVisualTokens` / `RequestTooLong`)."""
        specs = list(inputs)
        distinct = {media_identity(spec): spec for spec in specs}
        with self._vision_lock:
            if budget is not None:
                check_media_budget(self.pipeline, specs, budget)
            items = self.pipeline.encode(list(distinct.values()))
        if budget is not None:
            check_encoded(items, budget)
        return _repeated(specs, dict(zip(distinct, items, strict=True)))

    def encode_cached(
        self, inputs: Sequence[VideoInput | ImageInput], *, budget: MediaBudget | None = None
    ) -> list[MultiModalItem] | None:
        """What `encode` returns when every input is in the encoder cache, else None. It waits
        for no encode in progress (only hashing, EVS and the budget check run), so a question
        about a video already seen is not queued behind other videos' encoding."""
        specs = list(inputs)
        distinct = {media_identity(spec): spec for spec in specs}
        items = self.pipeline.encode_cached(list(distinct.values()))
        if items is None:
            return None
        if budget is not None:
            check_media_budget(self.pipeline, specs, budget)
        return _repeated(specs, dict(zip(distinct, items, strict=True)))

    def plan(
        self,
        video: VideoSource,
        *,
        evs: EVSChoice = UNSET,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_video_tokens: int | None = None,
        pixels: Mapping[str, int] | None = None,
        **options,
    ) -> VideoPlan:
        """The token plan of a video file before any decoding (`vision.video_plan`): what
        `describe` with the same options would sample and keep, and whether it fits. Options
        are `describe_many`'s `fps`, `start`, `end`, `max_frames`, `num_frames`, `resize`."""
        spec = video_input(video, self.resolve_evs(evs), pixels, **options)
        scheduler = self.engine.config.scheduler
        limits = PlanLimits(
            max_model_len=scheduler.max_model_len,
            max_visual_tokens=scheduler.max_visual_tokens_per_request,
            max_video_tokens=max_video_tokens,
            max_tokens=max_tokens,
            kv_dtype_bytes=self.kv_dtype_bytes,
        )
        return plan_video(self.pipeline, spec, limits)

    def resolve_evs(self, evs: EVSChoice) -> EVSConfig | None:
        """`evs` as a setting: `UNSET` is `evs_default`'s (None: EVS off)."""
        if isinstance(evs, str):
            if evs != UNSET:
                raise ValueError(f"evs={evs!r}: give an EVSConfig, None (off) or {UNSET!r}")
            return self.evs_default.evs
        return evs

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes of one K or V element in the engine's KV pool."""
        engine = self.engine
        return engine.weight_format.kv_cache_dtype(engine.config.kv_cache_dtype).itemsize

    def budget(self, max_tokens: int, max_video_tokens: int | None = None) -> MediaBudget:
        """What a request's media may cost beside an answer of `max_tokens`."""
        return MediaBudget.of(self.engine.config.scheduler, max_tokens, max_video_tokens)

    def start_async(self, *, max_queue: int = 64) -> AsyncEngine:
        """Hand the engine to a background `AsyncEngine`; `describe` is refused from then on."""
        with self._engine_lock:
            if self._async_engine is not None:
                raise RuntimeError("this VideoLLM's engine is already driven by an AsyncEngine")
            self._async_engine = AsyncEngine(self.engine, max_queue=max_queue)
            return self._async_engine

    def describe(
        self, video: VideoSource, prompt: str = DEFAULT_PROMPT, **options
    ) -> DescribeResult:
        """Describe one video: a path, bytes, a binary file object or a `[T, H, W, 3]` uint8
        frame array. Options are those of `describe_many`."""
        return self.describe_many([video], prompt, **options)[0]

    def describe_many(
        self,
        videos: Sequence[VideoSource],
        prompt: str = DEFAULT_PROMPT,
        *,
        evs: EVSChoice = UNSET,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        fps: float | None = None,
        start: float | None = None,
        end: float | None = None,
        max_frames: int | None = None,
        num_frames: int | None = None,
        pixels: Mapping[str, int] | None = None,
        max_video_tokens: int | None = None,
        resize: str | None = None,
        frames_fps: float = 2.0,
        timestamps: Sequence[float] | None = None,
        progress: bool = False,
    ) -> list[DescribeResult]:
        """Describe several videos with one prompt; they are encoded one after another and
        generated together. `evs=None` keeps every token; without `evs`, `evs_default`
        applies. `fps`, `start`, `end`, `max_frames`, `num_frames` (exactly that many, evenly),
        `pixels` (the family's pixel budget, e.g. {"max_pixels": 200704}) and `resize`
        ("exact" or "fast", see `DecodeConfig.resize`; None: the `VideoLLM`'s) apply to files;
        a frame array is taken as sampled at `frames_fps` (or at `timestamps`). Videos keeping
        more than `max_video_tokens` in all are refused (before decoding where the plan
        says so). `progress` shows bars on stderr."""
        arrival = time.monotonic()
        evs = self.resolve_evs(evs)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(stop),
        )
        stamps = None if timestamps is None else tuple(float(t) for t in timestamps)
        options = {"start": start, "end": end, "fps": fps, "max_frames": max_frames}
        options |= {"num_frames": num_frames, "frames_fps": frames_fps, "timestamps": stamps}
        options["resize"] = resize
        specs = [video_input(video, evs, pixels, **options) for video in videos]
        budget = self.budget(max_tokens, max_video_tokens)

        def encode_each() -> list[MultiModalItem]:
            # each video is a request of its own: the budget holds for each, not for their sum
            return [self.encode([spec], budget=budget)[0] for spec in specs]

        items = run_with_bar("decode + encode", encode_each, enabled=progress)
        prompts = [self.processor.build_text(prompt, [item]) for item in items]
        outputs = self._generate(prompts, params, progress=progress)
        setting = "off" if evs is None or evs.is_off else evs.key()
        return [
            describe_result([item], output, arrival, setting)
            for item, output in zip(items, outputs, strict=True)
        ]

    def narrate(
        self,
        source: str | PathLike | Frames,
        prompt: str = DEFAULT_NARRATE_PROMPT,
        *,
        realtime: bool = False,
        **options,
    ) -> Iterator[Segment]:
        """Narrate a video file (a path) or an iterator of (timestamp, [H, W, 3] uint8 frame),
        yielding segments as they come. Options are the WebSocket's narrate options
        (`NarrateOptions`; here `lag` defaults to "queue"); `realtime` paces frames at their
        timestamps. A file streams (`narrate_api.file_frames`) under this `VideoLLM`'s decode
        caps. The engine is busy with it until the iterator ends or is closed."""
        narrate_options = NarrateOptions(prompt=prompt, **{"lag": "queue", **options})
        if isinstance(source, str | PathLike):
            narrate_options = for_file(narrate_options, self.pipeline.decode_config)
            source = file_frames(source, narrate_options.fps, self.pipeline.decode_config)
        with self._engine_here("narrate through the server's WebSocket instead"):
            yield from narrate_frames(
                self.engine, self.pipeline, source, narrate_options, realtime=realtime
            )

    def summarize(
        self,
        video: VideoSource,
        *,
        questions: Sequence[str] = (),
        evs: EVSChoice = UNSET,
        progress: bool = False,
        **options,
    ) -> VideoSummary:
        """Summarise a video file longer than one context: caption it chunk by chunk, each
        caption with its chunk's times (the timeline), then aggregate the captions (in as many
        rounds as the context needs). Options: `chunk_s` (default: the longest chunk that fits
        the context and the token limits, see `vision.summary.chunks`), `overlap_s`,
        `caption_tokens`, `summary_tokens`, `summarize` (False: the timeline only),
        `max_in_flight`, `max_chunks`, `captions_per_round`, and the video's `fps`, `start`,
        `end`, `pixels` and `max_video_tokens` (per chunk). `questions` ask when something
        happens; their answers come from the timeline (`VideoSummary.answers`). Asking
        again about the same video reuses the encoder and prefix caches. Without `evs`, the
        chunks prune with the default, but a chunk it would prune to about its first tubelet
        is captioned whole (`vision.summary.chunks`)."""
        with self._engine_here("send summaries to the server instead"):
            return summarize_here(self, video, evs, questions, progress, **options)

    def when(self, video: VideoSource, question: str, **options) -> TemporalAnswer:
        """When, in `video`, what `question` asks about happens ("when does the red square
        appear?"), from the timeline alone (no summary is made). Options are `summarize`'s."""
        timeline = self.summarize(video, questions=[question], summarize=False, **options)
        return timeline.answers[0]

    def run_vision(self, fn: Callable[[], T]) -> T:
        """`fn()` with the vision pipeline to itself (thread-safe: one such call at a time)."""
        with self._vision_lock:
            return fn()

    @contextlib.contextmanager
    def _engine_here(self, instead: str) -> Iterator[None]:
        """The engine stepped from this thread, refused once an AsyncEngine drives it."""
        with self._engine_lock:
            if self._async_engine is not None:
                raise RuntimeError(
                    f"this VideoLLM serves requests through its AsyncEngine; {instead}"
                )
            yield

    def _generate(
        self, prompts: list[Prompt], params: SamplingParams, *, progress: bool
    ) -> list[RequestOutput]:
        """Run the prompts to completion on this thread; final outputs in prompt order."""
        with self._engine_here("send them to the server instead of calling describe"):
            request_ids = [self.engine.add_request(prompt, params) for prompt in prompts]
            final: dict[str, RequestOutput] = {}
            bar = TokenBar(params.max_tokens * len(prompts), enabled=progress)
            try:
                while len(final) < len(request_ids):
                    for output in self.engine.step():
                        bar.advance(len(output.new_token_ids))
                        if output.finished:
                            final[output.request_id] = output
            finally:
                bar.close()
                for request_id in request_ids:
                    if request_id not in final:
                        self.engine.abort(request_id)
            return [final[request_id] for request_id in request_ids]


def video_input(
    video: VideoSource, evs: EVSConfig | None, pixels: Mapping[str, int] | None, **options
) -> VideoInput:
    """A `VideoInput` from the Python API's options (`pixels` as a mapping)."""
    return VideoInput(video, evs=evs, pixels=tuple(sorted(dict(pixels or {}).items())), **options)


def describe_video(
    video: VideoSource,
    prompt: str = DEFAULT_PROMPT,
    *,
    model: str | PathLike | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    quantization_skip: Sequence[str] | None = None,
    kv_cache_dtype: str | None = None,
    compute_dtype: str | None = None,
    **options,
) -> DescribeResult:
    """Describe a video with the model `model` (None: the demo checkpoint), loaded on first use
    (its weights stored as `dtype`, `quantization`, `quantization_skip` and `kv_cache_dtype`
    say, computing in `compute_dtype`, see `EngineConfig`) and kept for later calls. Options
    are those of `VideoLLM.describe_many`."""
    precision = (dtype, quantization, tuple(quantization_skip or ()), kv_cache_dtype, compute_dtype)
    llm = _cached_llm(None if model is None else os.fspath(model), precision)
    return llm.describe(video, prompt, **options)


def summarize_video(video: VideoSource, *, model: str | PathLike | None = None, **options):
    """Summarise a video with the model `model` (None: the demo checkpoint), loaded on first
    use and kept for later calls. Options are those of `VideoLLM.summarize`."""
    llm = _cached_llm(None if model is None else os.fspath(model), (None, None, (), None, None))
    return llm.summarize(video, **options)


@functools.lru_cache(maxsize=2)
def _cached_llm(model: str | None, precision: tuple) -> VideoLLM:
    return VideoLLM(model, **dict(zip(PRECISION_OPTIONS, precision, strict=True)))


def _model_name(model: str | PathLike) -> str:
    """A local folder is named by its last part (never a machine path); a hub id as given."""
    path = Path(model)
    return path.name if path.is_dir() else os.fspath(model)


def _repeated(
    specs: list[VideoInput | ImageInput], encoded: dict[object, MultiModalItem]
) -> list[MultiModalItem]:
    """One item per spec, repeats sharing their distinct input's item."""
    return [encoded[media_identity(spec)] for spec in specs]
