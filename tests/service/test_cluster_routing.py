"""The cluster's routing and metrics pieces on their own, no Ray instance: affinity keys of real
request bodies, rendezvous placement and its load margin, the router class as Ray ships it,
and the merge of replicas' metrics."""

import asyncio
import base64
import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray.serve.config import RequestRouterConfig
from starlette.datastructures import Headers

from stillcut.service.app import create_app
from stillcut.service.cluster.affinity import (
    TEXT_KEY_CHARS,
    chat_key,
    media_key,
    upload_key,
)
from stillcut.service.cluster.cluster_metrics import IngressMetrics
from stillcut.service.cluster.ingress import IngressState, cluster_health, create_ingress_app
from stillcut.service.cluster.router import MediaAffinityRouter, place, rendezvous_order
from stillcut.service.config import ServerConfig
from stillcut.service.record import RequestRecord

SLOTS = {f"replica-{n}": f"rank-{n}" for n in range(4)}
KEYS = [media_key(b"video %d" % n) for n in range(400)]


def _chat(*parts, text_first: str | None = None) -> bytes:
    content = [{"type": "text", "text": text_first}] if text_first else []
    content += list(parts)
    return json.dumps({"messages": [{"role": "user", "content": content}]}).encode()


def _video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_chat_key_is_the_first_media_items_content():
    clip, other = b"\x00\x00\x00 ftypisom clip bytes", b"another clip"
    data = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    body = _chat(_video_part(data), _video_part("http://media.example/b.mp4"), text_first="hi")
    assert chat_key(body) == media_key(clip)  # decoded: an upload of these bytes meets it
    reencoded = "data:video/webm;base64," + base64.b64encode(clip).decode()
    assert chat_key(_chat(_video_part(reencoded))) == media_key(clip)
    assert chat_key(_chat(_video_part("data:video/mp4;base64," + base64.b64encode(other).decode())))
    assert chat_key(_chat(_video_part("http://media.example/a.mp4"))) != chat_key(
        _chat(_video_part("http://media.example/b.mp4"))
    )
    assert chat_key(_chat(_video_part("data:video/mp4;base64,@@@"))) is None  # replica's 400


def test_chat_key_of_text_is_its_first_256_characters():
    long_prompt = "a" * TEXT_KEY_CHARS
    first = json.dumps({"messages": [{"role": "system", "content": long_prompt}]}).encode()
    turns = [
        {"role": "system", "content": long_prompt},
        {"role": "user", "content": [{"type": "text", "text": "a later turn"}]},
    ]
    assert chat_key(first) == chat_key(json.dumps({"messages": turns}).encode())
    assert chat_key(_chat(text_first="one question")) != chat_key(_chat(text_first="another"))
    for unparsable in (b"[" * 100_000, b"not json", b'{"messages": 3}', b"[]"):
        assert chat_key(unparsable) is None


def test_upload_key_is_the_files_bytes_whatever_the_other_fields():
    clip = b"\x00\x00\x00 ftypisom an uploaded clip"

    def form(prompt: str) -> tuple[bytes, Headers]:
        request = httpx.Request(
            "POST",
            "http://server/v1/videos/describe",
            files={"file": ("c.mp4", clip, "video/mp4")},
            data={"prompt": prompt},
        )
        return request.read(), Headers(dict(request.headers))

    keys = {asyncio.run(upload_key(*form(prompt))) for prompt in ("What moves?", "And now?")}
    assert keys == {media_key(clip)}
    assert asyncio.run(upload_key(b"{}", Headers({"content-type": "application/json"}))) is None


def test_rendezvous_moves_only_a_leaving_replicas_keys_and_its_replacement_takes_them_back():
    before = {key: rendezvous_order(key, SLOTS)[0] for key in KEYS}
    assert set(before.values()) == set(SLOTS)  # 400 keys reach all 4 replicas
    survivors = {replica: slot for replica, slot in SLOTS.items() if replica != "replica-2"}
    after = {key: rendezvous_order(key, survivors)[0] for key in KEYS}
    assert {key for key in KEYS if before[key] != after[key]} == {
        key for key in KEYS if before[key] == "replica-2"
    }
    replacement = {**survivors, "restarted": "rank-2"}  # Ray gives it the rank it left free
    again = {key: rendezvous_order(key, replacement)[0] for key in KEYS}
    assert again == {key: "restarted" if r == "replica-2" else r for key, r in before.items()}


def test_place_keeps_the_preferred_replica_within_the_margin_then_diverts():
    key = KEYS[0]
    order = rendezvous_order(key, SLOTS)
    idle = dict.fromkeys(SLOTS, 0)
    assert place(key, SLOTS, idle, margin=4) == (order[0], order[0])
    busy = {**idle, order[0]: 4}
    assert place(key, SLOTS, busy, margin=4) == (order[0], order[0])  # at the margin: stays
    busier = {**idle, order[0]: 5}
    assert place(key, SLOTS, busier, margin=4) == (order[1], order[0])  # past it: next in order
    loads = {order[0]: 9, order[1]: 3, order[2]: 2, order[3]: 2}
    assert place(key, SLOTS, loads, margin=4) == (order[2], order[0])  # least-loaded, key order


SHIPPED_ROUTER = """
import sys
from ray import cloudpickle
from stillcut.service.cluster.affinity import RouteHint
router = cloudpickle.loads(sys.stdin.buffer.read())
hint_class = router.choose_replicas.__globals__["RouteHint"]
print(router.__module__, hint_class is RouteHint)
"""


def test_the_router_as_ray_ships_it_reads_the_ingresss_hints():
    """Ray sends the router's module by value to the process that routes; `RouteHint` there
    must still be the class the ingress makes its hints with, or every hint is ignored."""
    config = RequestRouterConfig(request_router_class=MediaAffinityRouter)
    shipped = subprocess.run(
        [sys.executable, "-c", SHIPPED_ROUTER],
        input=config.get_serialized_request_router_cls(),
        capture_output=True,
        timeout=120,
    )
    assert shipped.returncode == 0, shipped.stderr.decode()[-2000:]
    assert shipped.stdout.decode().split() == ["stillcut.service.cluster.router", "True"]


def _replica_text(requests: int, blocks: int) -> str:
    registry = CollectorRegistry()
    counter = Counter("stillcut_requests", "d", ["endpoint", "status"], registry=registry)
    counter.labels("/v1/chat/completions", "200").inc(requests)
    Gauge("stillcut_kv_blocks_used", "d", registry=registry).set(blocks)
    return generate_latest(registry).decode()


def test_metrics_merge_labels_every_replica_series_and_counts_routing():
    metrics = IngressMetrics()
    for replica, affinity in (("a", True), ("a", True), ("b", False)):
        record = RequestRecord("req", "/v1/chat/completions", "POST", 0.0, status=200)
        record.replica, record.affinity = replica, affinity
        metrics.observe(record)
    text = metrics.render([("a", _replica_text(2, 7)), ("b", _replica_text(1, 3))], 3).decode()
    samples = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name: str, **labels) -> float:
        return samples[name, frozenset(labels.items())]

    chat = {"endpoint": "/v1/chat/completions", "status": "200"}
    assert value("stillcut_requests_total", **chat, replica="a") == 2
    assert value("stillcut_requests_total", **chat, replica="b") == 1
    assert value("stillcut_kv_blocks_used", replica="a") == 7
    assert value("stillcut_kv_blocks_used", replica="b") == 3
    assert value("stillcut_routed_requests_total", replica="a", affinity="true") == 2
    assert value("stillcut_routed_requests_total", replica="b", affinity="false") == 1
    assert value("stillcut_ingress_requests_total", **chat) == 3
    assert (value("stillcut_replicas_up"), value("stillcut_replicas_total")) == (2, 3)
    assert text.count("# TYPE stillcut_kv_blocks_used gauge") == 1  # one family, both replicas


@pytest.mark.parametrize("fields", [{"cached_tokens": 32, "ttft_s": 0.5, "status": 500}])
def test_a_record_takes_a_replicas_counts_but_keeps_its_own_status(fields):
    record = RequestRecord("req", "/v1/chat/completions", "POST", 0.0, status=200)
    record.replica, record.affinity = "a", True
    record.take_counts(fields)
    assert (record.cached_tokens, record.ttft_s, record.status) == (32, 0.5, 200)
    logged = record.log_fields()
    assert (logged["replica"], logged["affinity"], logged["cached_tokens"]) == ("a", True, 32)


def _health_report(replica: str, status: str, blocks_used: int) -> dict:
    """One replica's own `/health` body, as `EngineReplica.health` returns it."""
    return {
        "replica": replica,
        "status": status,
        "model": "tiny",
        "weight_format": "float32",
        "weight_bytes": 1000,
        "vision_weight_bytes": 100,
        "kv_cache_dtype": "float32",
        "kv_cache_bytes": 4096,
        "kv_blocks_used": blocks_used,
        "kv_blocks_total": 64,
        "requests_waiting": 1,
        "requests_running": 2,
        "live_sessions": 1,
        "evs_default": {"mode": "rate", "rate": 0.75},
    }


def test_cluster_health_counts_replicas_up_and_is_unavailable_only_with_none():
    both = [_health_report("b", "ok", 3), _health_report("a", "ok", 5)]
    health = cluster_health(both, 2)
    assert (health["status"], health["replicas_up"], health["replicas_total"]) == ("ok", 2, 2)
    assert (health["kv_blocks_used"], health["kv_blocks_total"]) == (8, 128)
    assert (health["weight_format"], health["weight_bytes"]) == ("float32", 2000)
    assert [report["replica"] for report in health["replicas"]] == ["a", "b"]
    stopped_loop = [_health_report("a", "unavailable", 0), _health_report("b", "ok", 3)]
    assert cluster_health(stopped_loop, 2)["status"] == "degraded"
    one_missing = cluster_health([_health_report("b", "ok", 3)], 2)  # "a" did not answer
    assert (one_missing["status"], one_missing["replicas_up"]) == ("degraded", 1)
    none = cluster_health([], 2)
    assert (none["status"], none["replicas_up"], none["kv_blocks_total"]) == ("unavailable", 0, 0)


def test_the_ingress_answers_every_path_a_single_server_answers(reference_llm):
    def paths(app) -> set[tuple[str, frozenset]]:
        return {
            (route.path, frozenset(getattr(route, "methods", None) or ())) for route in app.routes
        }

    config = ServerConfig()
    ingress = create_ingress_app(IngressState(config, None, 2, IngressMetrics()))
    single = paths(create_app(reference_llm, config))
    assert ("/v1/videos/plan", frozenset({"POST"})) in single
    assert paths(ingress) == single
