"""From a step's accepted tokens to what a caller reads: text, metrics, finish reasons.

Each request the engine runs is tracked here with its incremental detokenizer (which also
matches stop strings) and its metrics. A stop string that completes ends the request where it
completed, whatever the tokens said: tokens after it (accepted drafts, sampled in the same
step) were never generated, and the scheduler is told to finish the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stillcut.engine.detokenizer import IncrementalDetokenizer
from stillcut.engine.outputs import RequestMetrics, RequestOutput, Snapshot
from stillcut.engine.request import Request, RequestStatus
from stillcut.engine.scheduler_output import RequestUpdate, SchedulerOutput


@dataclass
class TrackedRequest:
    """A request's detokenizer, metrics and log-probabilities so far."""

    request: Request
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list = field(default_factory=list)
    counting_append: bool = False  # its appended input is being prefilled


class OutputProcessor:
    """The tracked requests, by id. `finish_request(request_id, status)` ends a request in the
    scheduler (a stop string completed)."""

    def __init__(self, tokenizer, finish_request: Callable[[str, RequestStatus], object]) -> None:
        self.tokenizer = tokenizer
        self.finish_request = finish_request
        self.tracked: dict[str, TrackedRequest] = {}

    def track(self, request: Request, stop: Sequence[str]) -> None:
        """Start tracking a request just added to the scheduler."""
        video = [item for item in request.mm_items if item.kind == "video"]
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            num_prompt_tokens=request.num_prompt_tokens,
            video_tokens_kept=sum(item.num_tokens for item in video),
            video_tokens_total=sum(item.num_dense_tokens for item in video),
        )
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, stop=tuple(stop)
        )
        self.tracked[request.request_id] = TrackedRequest(request, detokenizer, metrics)

    def track_append(self, request_id: str, num_new_tokens: int) -> None:
        """Input was appended to a live request: count its prefill, detokenize after it."""
        tracked = self.tracked[request_id]
        request, metrics = tracked.request, tracked.metrics
        metrics.num_prompt_tokens += num_new_tokens
        metrics.append_prefill_tokens.append(0)
        tracked.counting_append = True
        context = request.token_ids_between(max(request.num_tokens - 8, 0), request.num_tokens)
        tracked.detokenizer = IncrementalDetokenizer(self.tokenizer, context)

    def record_schedule(self, scheduled: SchedulerOutput, now: float) -> None:
        """A step was scheduled: first-schedule times, cache hits, appended prefill tokens."""
        for new in scheduled.scheduled_new:
            tracked = self.tracked.get(new.request_id)
            if tracked is not None and tracked.metrics.first_scheduled_time is None:
                tracked.metrics.first_scheduled_time = now
                tracked.metrics.num_cached_tokens = tracked.request.num_cached_tokens
        for request_id, num_tokens in scheduled.num_scheduled_tokens.items():
            tracked = self.tracked.get(request_id)
            if tracked is not None and tracked.counting_append:
                tracked.metrics.append_prefill_tokens[-1] += num_tokens

    def process(
        self, tracked: TrackedRequest, update: RequestUpdate, now: float, logprobs: list
    ) -> RequestOutput:
        """The output of one request's step; a finished request (not a held one) is no
        longer tracked."""
        request, metrics = tracked.request, tracked.metrics
        new_token_ids = update.new_token_ids
        if new_token_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
        delta = tracked.detokenizer.push(new_token_ids)
        finish_reason = None if update.segment_end else finish_reason_of(update.status)
        stop_reason = update.stop_reason
        if tracked.detokenizer.finished and finish_reason not in ("stop", "held"):
            # a stop string completed: end the request here, whatever the tokens said; tokens
            # after it (accepted drafts, sampled in the same step) were never generated
            num_unread = tracked.detokenizer.num_unread_tokens
            if num_unread:
                del request.output_token_ids[-num_unread:]
                new_token_ids = new_token_ids[:-num_unread]
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            finish_reason, stop_reason = "stop", tracked.detokenizer.stop_reason
        elif finish_reason in ("stop", "length", "abort") or update.segment_end is not None:
            delta += tracked.detokenizer.flush()
        metrics.num_generated_tokens = len(request.output_token_ids)
        tracked.logprobs.extend(logprobs[: len(new_token_ids)])
        finished = finish_reason is not None
        if finished:
            metrics.finished_time = now
            if finish_reason != "held":
                self.tracked.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            token_ids=Snapshot(request.output_token_ids),
            new_token_ids=new_token_ids,
            text_pieces=Snapshot(tracked.detokenizer.pieces),
            delta=delta,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            metrics=metrics,
            logprobs=Snapshot(tracked.logprobs),
            segment_end=update.segment_end,
        )


def finish_reason_of(status: RequestStatus) -> str | None:
    """The OpenAI-style finish reason of a request's status; None while it runs."""
    if status is RequestStatus.HELD:
        return "held"
    return status.value if status.is_finished else None
