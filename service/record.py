"""What the server remembers about one request, for its log line and its metrics.

The middleware opens a record when a request arrives and closes it when the last byte is sent
(or the WebSocket closes); handlers fill in tokens, EVS counts, timings and errors as they
learn them. One JSON log line per request comes from `log_fields`. Behind a cluster ingress,
the record there also names the replica that served the request and whether it was the one
its affinity key prefers, and takes the replica's own counts once the replica is done.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.multimodal import MultiModalItem
from stillcut.service.result import evs_summary, media_seconds, timings_of, usage_of


@dataclass
class RequestRecord:
    """One request's facts; `arrival` is `time.monotonic()` when it came in."""

    request_id: str
    endpoint: str
    method: str
    arrival: float
    status: int | None = None
    ended: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    evs_kept: int = 0
    evs_total: int = 0
    decode_s: float | None = None
    encode_s: float | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    replica: str | None = None  # the replica that served it (cluster ingress only)
    affinity: bool | None = None  # whether that replica is the one its key prefers

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.monotonic()) - self.arrival

    def add_media(self, items: Sequence[MultiModalItem], run_s: float) -> None:
        """Count encoded media (EVS tokens) and the seconds it took: `run_s` is the wall time
        of the request's encoding job, of which decoding took `decode_s` and the rest
        (preprocessing, the tower, EVS) is `encode_s`. Items share one tower pass, so
        their own `encode_s` would count it once per item."""
        summary = evs_summary(items, "")
        self.evs_kept += summary.tokens_after
        self.evs_total += summary.tokens_before
        decode_s, _ = media_seconds({id(item): item for item in items}.values())
        self.decode_s = (self.decode_s or 0.0) + decode_s
        self.encode_s = (self.encode_s or 0.0) + max(0.0, run_s - decode_s)

    def add_output(self, items: Sequence[MultiModalItem], output: RequestOutput) -> None:
        """Count a finished generation (tokens, queue time, time to first token)."""
        usage = usage_of(output)
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens
        timings = timings_of(items, output, self.arrival)
        self.queue_s = timings.queue_s
        if self.ttft_s is None and output.token_ids:
            self.ttft_s = timings.ttft_s
        self.finish_reason = output.finish_reason

    def take_counts(self, fields: Mapping[str, Any]) -> None:
        """Take the tokens, EVS counts, timings and finish reason from another record's
        `log_fields` (a replica's, as the ingress receives it)."""
        for name in _COUNTED_FIELDS:
            if name in fields:
                setattr(self, name, fields[name])

    def log_fields(self) -> dict:
        """The structured log line's fields (None ones left out)."""
        fields = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "method": self.method,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "evs_kept": self.evs_kept,
            "evs_total": self.evs_total,
            "finish_reason": self.finish_reason,
            "error": self.error_code,
            "replica": self.replica,
            "affinity": self.affinity,
            "decode_s": self.decode_s,
            "encode_s": self.encode_s,
            "queue_s": self.queue_s,
            "ttft_s": self.ttft_s,
            "total_s": self.elapsed_s,
        }
        return {
            key: round(value, 4) if isinstance(value, float) else value
            for key, value in fields.items()
            if value is not None
        }


_COUNTED_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "evs_kept",
    "evs_total",
    "finish_reason",
    "decode_s",
    "encode_s",
    "queue_s",
    "ttft_s",
)


class RecordObserver(Protocol):
    """What the request middleware hands each finished record to (the server's metrics)."""

    def observe(self, record: RequestRecord) -> None: ...
