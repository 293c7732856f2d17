"""Prometheus metrics of one server, in a registry of its own (never the global one).

Request counters and latency histograms are updated once per finished request, from its
`RequestRecord`. Engine state (KV blocks, prefix-cache hit rate, queue depth) is read at
scrape time from the snapshot the engine thread publishes, so a scrape never touches the
engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from stillcut.service.async_engine import EngineStats
from stillcut.service.record import RequestRecord
from stillcut.vision.work import VisionWork

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        encoder_pending: Callable[[], int],
        work: Callable[[], VisionWork],
    ):
        self._stats = stats
        self._encoder_pending = encoder_pending
        self._work = work

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        work = self._work()
        yield CounterMetricFamily(
            "stillcut_frames_decoded", "video frames decoded, images opened", work.frames_decoded
        )
        yield CounterMetricFamily(
            "stillcut_vision_tower_passes", "calls of the vision tower", work.tower_passes
        )
        stats = self._stats()
        yield from _speculation_metrics(stats)
        counters = (
            ("saved", "recurrent-state snapshots saved at block boundaries"),
            ("restored", "prefix-cache hits that restored a recurrent-state snapshot"),
            ("evicted", "recurrent-state snapshots evicted"),
        )
        for name, documentation in counters:
            value = getattr(stats, f"state_snapshots_{name}")
            yield CounterMetricFamily(f"stillcut_state_snapshots_{name}", documentation, value)
        gauges = (
            ("stillcut_kv_blocks_used", "KV cache blocks held by requests", stats.num_blocks_used),
            ("stillcut_kv_blocks_total", "KV cache blocks in the pool", stats.num_blocks),
            (
                "stillcut_prefix_cache_hit_rate",
                "share of prompt tokens served from the prefix cache",
                stats.prefix_cache_hit_rate,
            ),
            (
                "stillcut_queue_depth",
                "requests waiting for the encoder or the scheduler",
                stats.num_waiting + self._encoder_pending(),
            ),
            ("stillcut_requests_running", "requests the engine is running", stats.num_running),
            ("stillcut_held_prefixes", "held prefixes of live sessions", stats.num_held),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)


def _speculation_metrics(stats: EngineStats) -> Iterator[CounterMetricFamily]:
    """Draft tokens scored, those accepted, and a histogram of accepted tokens per verify step
    (bucket `le=j` counts steps that accepted at most j drafts)."""
    yield CounterMetricFamily(
        "stillcut_spec_draft_tokens", "speculative draft tokens scored", stats.spec_draft_tokens
    )
    yield CounterMetricFamily(
        "stillcut_spec_accepted_tokens", "speculative draft tokens accepted",
        stats.spec_accepted_tokens,
    )  # fmt: skip
    per_step = stats.spec_accepted_per_step
    buckets = [(str(j), sum(per_step[: j + 1])) for j in range(len(per_step))]
    yield HistogramMetricFamily(
        "stillcut_spec_accepted_tokens_per_step",
        "draft tokens accepted per verify step",
        buckets=[*buckets, ("+Inf", sum(per_step))],
        sum_value=sum(j * n for j, n in enumerate(per_step)),
    )


class ServiceMetrics:
    """The server's metrics; `observe` a record when its request ends, `render` to scrape."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        encoder_pending: Callable[[], int],
        work: Callable[[], VisionWork],
    ):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "stillcut_requests",
            "finished requests by endpoint and HTTP status (WebSocket: close code)",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "stillcut_time_to_first_token_seconds",
            "from a request's arrival to its first generated token",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "stillcut_request_duration_seconds",
            "from a request's arrival to its last byte",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.evs_kept = Counter(
            "stillcut_evs_tokens_kept", "video tokens kept by EVS", registry=self.registry
        )
        self.evs_pruned = Counter(
            "stillcut_evs_tokens_pruned", "video tokens dropped by EVS", registry=self.registry
        )
        self.registry.register(_EngineCollector(stats, encoder_pending, work))

    def observe(self, record: RequestRecord) -> None:
        self.requests.labels(record.endpoint, str(record.status)).inc()
        self.e2e.labels(record.endpoint).observe(record.elapsed_s)
        if record.ttft_s is not None:
            self.ttft.labels(record.endpoint).observe(record.ttft_s)
        self.evs_kept.inc(record.evs_kept)
        self.evs_pruned.inc(record.evs_total - record.evs_kept)

    def render(self) -> bytes:
        return generate_latest(self.registry)
