"""A token plan for one video before any work: from its headers and its packet index only.

The packet scan (no decoding) gives the sample times and the frame each one takes; the
family's resize rule gives the token grid; EVS's rule gives what survives: exactly in rate
mode (vLLM's `max(h*w, int(t*h*w*(1-q)))`) and with EVS off, and as a range in threshold mode
(the first tubelet whole plus each later one's floor, up to its cap; the encoder decides where
in it). With the language model's KV bytes per token and the engine's limits, the plan says
whether the request fits, and when it does not, the most frames that would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from stillcut.engine.cache_groups import kv_bytes_per_block
from stillcut.kernels.evs import EVSConfig
from stillcut.kernels.evs.config import num_retained_tokens


@dataclass(frozen=True)
class PlanLimits:
    """What a request's video tokens must fit (None: no such limit)."""

    max_model_len: int | None = None
    max_visual_tokens: int | None = None  # the engine's per-request visual token limit
    max_video_tokens: int | None = None  # the request's own total video token budget
    max_tokens: int = 0  # what the answer adds to the context
    kv_dtype_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_visual_tokens", "max_video_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 0):
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")

    @property
    def num_tokens(self) -> int | None:
        """The most video tokens that fit every limit (None: unlimited)."""
        room = None if self.max_model_len is None else self.max_model_len - self.max_tokens
        bounds = [b for b in (room, self.max_visual_tokens, self.max_video_tokens) if b is not None]
        return min(bounds) if bounds else None


def kept_range(grid: tuple[int, int, int], evs: EVSConfig | None) -> tuple[int, int]:
    """(fewest, most) tokens EVS keeps of a (t, h, w) token grid; equal unless threshold mode."""
    num_tubelets, tokens_per_tubelet = grid[0], grid[1] * grid[2]
    total = num_tubelets * tokens_per_tubelet
    if evs is None or evs.is_off:
        return total, total
    if evs.mode == "rate":
        kept = num_retained_tokens(num_tubelets, tokens_per_tubelet, evs.rate)
        return kept, kept
    later = num_tubelets - 1
    fewest = tokens_per_tubelet + later * min(evs.floor, tokens_per_tubelet)
    cap = tokens_per_tubelet if evs.max_per_tubelet is None else evs.max_per_tubelet
    return fewest, tokens_per_tubelet + later * min(cap, tokens_per_tubelet)


def most_frames(cost: Callable[[int], int], max_frames: int, affordable: int) -> int:
    """The most frames (at most `max_frames`) whose cost fits `affordable`; 0 if none."""
    low, high = 0, max_frames  # cost grows with the frame count: bisect
    while low < high:
        middle = (low + high + 1) // 2
        if cost(middle) <= affordable:
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(frozen=True)
class VideoPlan:
    """What encoding one video would sample and cost; `to_dict` is the JSON the routes send."""

    duration_s: float  # of the sampled range
    start_s: float
    end_s: float
    codec: str
    width: int  # as the header declares, before any rotation
    height: int
    source_fps: float | None
    sample_fps: float
    sample_times: tuple[float, ...]
    frame_times: tuple[float, ...] | None  # the pts time of the frame each sample takes
    sampling: str  # "dense" (one pass), "seek" (jumps some stretches) or "plain" (no index)
    num_seeks: int | None  # keyframe seeks past unsampled stretches (None: no packet index)
    pixel_budget: dict[str, int]
    token_grid: tuple[int, int, int]  # (tubelets, h, w) after merging
    tokens_before_evs: int
    tokens_after_evs: int  # exact in rate mode and with EVS off; the most in threshold mode
    tokens_after_evs_min: int
    evs: str
    evs_exact: bool
    kv_bytes: int  # of `tokens_after_evs` in the language model's KV cache
    max_video_tokens: int | None  # what the limits leave for the video
    fits: bool
    fitting_num_frames: int | None  # when it does not fit: the most frames that would

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in ("sample_times", "frame_times", "token_grid"):
            if data[name] is not None:
                data[name] = list(data[name])
        data["num_frames"] = len(self.sample_times)
        if self.fitting_num_frames is not None:
            data["fitting_fps"] = self.fitting_num_frames / max(self.duration_s, 1e-9)
        return data


def plan_video(pipeline, spec, limits: PlanLimits = PlanLimits()) -> VideoPlan:
    """The plan of `spec` (a `VideoInput` of a file) through `pipeline`, decoding nothing."""
    from stillcut.vision.decode import probe_video  # PyAV only where files are planned

    media = pipeline.media_with(spec.pixels)
    config = pipeline.decode_options(spec)
    probe = probe_video(spec.source, config, start=spec.start, end=spec.end)

    def grid_of(num_frames: int) -> tuple[int, int, int]:
        return media.token_grid("video", num_frames, probe.height, probe.width)

    grid = grid_of(probe.num_samples)
    fewest, most = kept_range(grid, spec.evs)
    per_token = kv_bytes_per_block(pipeline.model_config.cache_groups, 1, limits.kv_dtype_bytes)
    budget = limits.num_tokens
    fits = budget is None or most <= budget
    fitting = None
    if not fits:
        fitting = most_frames(
            lambda n: kept_range(grid_of(n), spec.evs)[1], config.max_frames, budget
        )
    sampling = "plain" if probe.num_seeks is None else "seek" if probe.num_seeks else "dense"
    return VideoPlan(
        duration_s=probe.duration,
        start_s=probe.start,
        end_s=probe.start + probe.duration,
        codec=probe.codec,
        width=probe.width,
        height=probe.height,
        source_fps=probe.source_fps,
        sample_fps=probe.sample_fps,
        sample_times=probe.sample_times,
        frame_times=probe.frame_times,
        sampling=sampling,
        num_seeks=probe.num_seeks,
        pixel_budget=media.pixel_budget() if pipeline.family.pixel_budget else {},
        token_grid=grid,
        tokens_before_evs=grid[0] * grid[1] * grid[2],
        tokens_after_evs=most,
        tokens_after_evs_min=fewest,
        evs="off" if spec.evs is None or spec.evs.is_off else spec.evs.key(),
        evs_exact=fewest == most,
        kv_bytes=most * per_token,
        max_video_tokens=budget,
        fits=fits,
        fitting_num_frames=fitting,
    )
