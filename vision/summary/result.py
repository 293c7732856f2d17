"""What a summary returns: the timeline, the summary, and what it cost.

The timeline is `[(start_s, end_s, caption)]`, one entry per chunk in order (`TimedCaption`);
`when(question)` answers a question about when something happens from it (`when`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.multimodal import MultiModalItem
from stillcut.vision.summary.prompts import TimedCaption
from stillcut.vision.summary.when import TemporalAnswer, answer_when


@dataclass
class SummaryUsage:
    """Counts over every request of a summary (captions and aggregation rounds)."""

    num_chunks: int = 0
    num_cached_chunks: int = 0  # chunks the encoder cache already held: never decoded
    num_whole_chunks: int = 0  # chunks a default rate would prune to their first tubelet: whole
    video_tokens_before: int = 0  # before EVS, over all chunks
    video_tokens_after: int = 0
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache held
    completion_tokens: int = 0

    def add_chunk(self, item: MultiModalItem, kept_whole: bool = False) -> None:
        self.num_chunks += 1
        self.num_whole_chunks += kept_whole
        self.num_cached_chunks += bool(item.stats.get("cache_hit"))
        self.video_tokens_before += item.num_dense_tokens
        self.video_tokens_after += item.num_tokens

    def add_output(self, output: RequestOutput) -> None:
        metrics = output.metrics
        self.num_requests += 1
        self.prompt_tokens += metrics.num_prompt_tokens
        self.cached_tokens += metrics.num_cached_tokens
        self.completion_tokens += len(output.token_ids)


@dataclass(frozen=True)
class SummaryTimings:
    """Seconds: decoding, preprocessing and the tower (summed over chunks; they overlap the
    captions), until the last caption, the aggregation rounds, and in all (wall time)."""

    decode_s: float
    preprocess_s: float
    encode_s: float
    caption_s: float
    aggregate_s: float
    total_s: float


@dataclass(frozen=True)
class VideoSummary:
    """A video's timeline and summary (empty when not asked for, or when every caption was)."""

    timeline: tuple[TimedCaption, ...]
    summary: str
    chunk_s: float
    overlap_s: float
    sample_fps: float
    start_s: float
    end_s: float
    evs: str  # the EVS setting of the chunks (but `usage.num_whole_chunks`, kept whole)
    num_rounds: int  # aggregation rounds (0: no summary asked for)
    usage: SummaryUsage
    timings: SummaryTimings
    answers: tuple[TemporalAnswer, ...] = field(default=())

    def when(self, question: str) -> TemporalAnswer:
        """When the timeline says what `question` ("when does the red square appear?") asks
        about (see `when.answer_when`)."""
        return answer_when(self.timeline, question)

    def to_dict(self) -> dict:
        """Plain JSON-ready data; the timeline as objects with `start_s`, `end_s`, `caption`."""
        data = asdict(self)
        data["timeline"] = [
            {"start_s": entry.start_s, "end_s": entry.end_s, "caption": entry.text}
            for entry in self.timeline
        ]
        data["answers"] = [answer.to_dict() for answer in self.answers]
        return data
