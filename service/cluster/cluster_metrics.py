"""The ingress's `/metrics`: every replica's own series with a `replica` label, and the
ingress's own.

Each replica renders its metrics as `stillcut serve` does; the ingress parses them and adds
`replica="<id>"` to every sample, so a query sums or splits them as it likes. The ingress
itself counts requests by endpoint and status (`stillcut_ingress_requests_total`), where it
sent them (`stillcut_routed_requests_total{replica, affinity}`: affinity is "true" when the
replica was the one the request's key prefers, "false" when it was diverted or had no key),
and the replicas up and deployed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from stillcut.service.record import RequestRecord


class IngressMetrics:
    """The ingress's counters; `observe` a record when its request ends."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "stillcut_ingress_requests",
            "requests finished at the ingress by endpoint and HTTP status (WebSocket: close code)",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.routed = Counter(
            "stillcut_routed_requests",
            "requests and sessions sent to a replica, and whether it was their key's choice",
            ["replica", "affinity"],
            registry=self.registry,
        )
        self.replicas_up = Gauge(
            "stillcut_replicas_up", "replicas that answered the scrape", registry=self.registry
        )
        self.replicas_total = Gauge(
            "stillcut_replicas_total", "replicas deployed", registry=self.registry
        )

    def observe(self, record: RequestRecord) -> None:
        self.requests.labels(record.endpoint, str(record.status)).inc()
        if record.replica is not None:
            self.routed.labels(record.replica, "true" if record.affinity else "false").inc()

    def render(self, replica_texts: Sequence[tuple[str, str]], num_replicas: int) -> bytes:
        """The ingress's series, then the replicas' (`replica_texts`: (id, metrics text))."""
        self.replicas_up.set(len(replica_texts))
        self.replicas_total.set(num_replicas)
        merged = CollectorRegistry()
        merged.register(_Labelled(replica_texts))
        return generate_latest(self.registry) + generate_latest(merged)


class _Labelled(Collector):
    """The replicas' families, one per name, each sample labelled with its replica."""

    def __init__(self, replica_texts: Sequence[tuple[str, str]]) -> None:
        self._replica_texts = replica_texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in self._replica_texts:
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    labels = {**sample.labels, "replica": replica}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield from families.values()
