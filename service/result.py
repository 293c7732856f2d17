"""What a description returns: the text, the tokens, what EVS kept, and where the time went.

`describe_result` builds one from the encoded video items and the request's final engine
output; the Python API, the REST endpoint and the CLI all report through it, so a description
looks the same whichever way it was asked for. Times count from the moment the request arrived
(the call, or the HTTP request), so `ttft_s` and `total_s` include decoding and encoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.multimodal import MultiModalItem


@dataclass(frozen=True)
class EVSSummary:
    """What EVS kept of the request's videos (summed when there are several)."""

    setting: str  # EVSConfig.key(), or "off"
    frames: int
    tokens_before: int
    tokens_after: int
    kept_per_tubelet: tuple[int, ...]
    videos: tuple[dict, ...] = ()  # per video: how it was sampled and what each tubelet kept

    @property
    def tokens_pruned(self) -> int:
        return self.tokens_before - self.tokens_after


@dataclass(frozen=True)
class Timings:
    """Seconds spent: decoding and encoding the video (preprocessing and EVS count as encode),
    waiting for the scheduler, to the first token and in all, from the request's arrival."""

    decode_s: float
    encode_s: float
    queue_s: float
    ttft_s: float
    total_s: float


@dataclass(frozen=True)
class Usage:
    """Token counts in the OpenAI sense; `cached_tokens` came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    accepted_prediction_tokens: int = 0  # speculative decoding: drafts accepted
    rejected_prediction_tokens: int = 0  # and drafts scored but rejected

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class DescribeResult:
    """A finished description of one video."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_reason: str | int | None  # the stop string or token id that ended it; None for EOS
    evs: EVSSummary
    timings: Timings
    usage: Usage
    frame_timestamps: tuple[float, ...]

    def to_dict(self) -> dict:
        """Plain JSON-ready data (lists instead of tuples)."""
        data = asdict(self)
        data["token_ids"] = list(self.token_ids)
        data["frame_timestamps"] = list(self.frame_timestamps)
        data["evs"]["kept_per_tubelet"] = list(self.evs.kept_per_tubelet)
        data["evs"]["videos"] = list(self.evs.videos)
        data["usage"]["total_tokens"] = self.usage.total_tokens
        return data


def evs_summary(items: Sequence[MultiModalItem], setting: str) -> EVSSummary:
    """The EVS numbers of the request's videos (images are never pruned, so they are left out)."""
    videos = [item for item in items if item.kind == "video"]
    return EVSSummary(
        setting=setting,
        frames=sum(item.stats.get("num_frames", len(item.timestamps)) for item in videos),
        tokens_before=sum(item.num_dense_tokens for item in videos),
        tokens_after=sum(item.num_tokens for item in videos),
        kept_per_tubelet=tuple(n for item in videos for n in item.kept_per_tubelet),
        videos=tuple(video_report(item) for item in videos),
    )


_ECHOED_STATS = ("sample_fps", "start", "end", "pixel_budget", "resize", "num_seeks")


def video_report(item: MultiModalItem) -> dict:
    """One video as it was fed to the model: the options in force, the frames sampled and
    their times, the token grid and what EVS kept of each tubelet."""
    stats = item.stats
    return {
        **{name: stats[name] for name in _ECHOED_STATS if name in stats},
        "num_frames": len(item.timestamps),
        "timestamps": list(item.timestamps),
        "resized": [stats.get("resized_width"), stats.get("resized_height")],
        "token_grid": list(item.llm_grid),
        "tokens_before": item.num_dense_tokens,
        "tokens_after": item.num_tokens,
        "kept_per_tubelet": list(item.kept_per_tubelet),
    }


def media_seconds(items: Sequence[MultiModalItem]) -> tuple[float, float]:
    """Decode and encode seconds of this request's items (zero for encoder-cache hits)."""
    decode_s = sum(item.stats.get("decode_s", 0.0) for item in items)
    encode_s = sum(
        item.stats.get(name, 0.0)
        for item in items
        for name in ("preprocess_s", "encode_s", "evs_s")
    )
    return decode_s, encode_s


def usage_of(output: RequestOutput) -> Usage:
    metrics = output.metrics
    return Usage(
        prompt_tokens=metrics.num_prompt_tokens,
        completion_tokens=len(output.token_ids),
        cached_tokens=metrics.num_cached_tokens,
        accepted_prediction_tokens=metrics.num_accepted_tokens,
        rejected_prediction_tokens=metrics.num_draft_tokens - metrics.num_accepted_tokens,
    )


def timings_of(items: Sequence[MultiModalItem], output: RequestOutput, arrival: float) -> Timings:
    """Timings of a finished request; `arrival` is `time.monotonic()` when it came in."""
    metrics = output.metrics
    decode_s, encode_s = media_seconds(items)
    first_token = metrics.first_token_time or metrics.finished_time or arrival
    finished = metrics.finished_time or first_token
    return Timings(
        decode_s=decode_s,
        encode_s=encode_s,
        queue_s=metrics.queue_time or 0.0,
        ttft_s=first_token - arrival,
        total_s=finished - arrival,
    )


def describe_result(
    items: Sequence[MultiModalItem], output: RequestOutput, arrival: float, evs_setting: str
) -> DescribeResult:
    """The result of a finished request about `items`."""
    assert output.finished, output
    return DescribeResult(
        text=output.text,
        token_ids=tuple(output.token_ids),
        finish_reason=output.finish_reason or "stop",
        stop_reason=output.stop_reason,
        evs=evs_summary(items, evs_setting),
        timings=timings_of(items, output, arrival),
        usage=usage_of(output),
        frame_timestamps=tuple(
            t for item in items if item.kind == "video" for t in item.timestamps
        ),
    )
