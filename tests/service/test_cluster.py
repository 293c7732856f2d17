"""`stillcut serve --replicas` end to end on one machine: a local Ray instance started and stopped
here, two replicas of the tiny checkpoint at half a CPU each, the official `openai` and
`websockets` clients against Ray's HTTP proxy on 127.0.0.1.

Where a request went is read from the ingress's `/metrics` (`stillcut_routed_requests_total`
by replica and affinity), which counts a request once its answer is out; requests here are
sent one at a time unless the test is about concurrency. The last test kills a replica."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import struct
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK
from websockets.sync.client import connect

from stillcut.service.cluster.affinity import media_key
from stillcut.service.cluster.launch import (
    APP_NAME,
    REPLICA_DEPLOYMENT,
    ClusterConfig,
    running_cluster,
)
from stillcut.service.cluster.replica import ReplicaSpec
from stillcut.service.cluster.router import rendezvous_order
from stillcut.service.config import ServerConfig
from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import DECODE_CONFIG, ENGINE_CONFIG, MAX_UPLOAD_BYTES, assert_error, data_url

MARGIN = 4
ROUTED = "stillcut_routed_requests_total"
SETTLE_S = 10.0  # a finished request is counted a moment after its last byte


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint) -> str:
    spec = ReplicaSpec(
        model=str(tiny_checkpoint),
        server=ServerConfig(max_upload_bytes=MAX_UPLOAD_BYTES, max_message_bytes=MAX_UPLOAD_BYTES),
        engine_config=ENGINE_CONFIG,
        decode_config=DECODE_CONFIG,
        num_cpus=0.5,
        log_level="warning",
    )
    config = ClusterConfig(
        num_replicas=2, num_cpus_per_replica=0.5, affinity_margin=MARGIN, num_cpus=2
    )
    before = set(_descendants(os.getpid()))  # e.g. multiprocessing's resource tracker
    with running_cluster(spec, config) as url:
        yield url
    assert _leftover_processes(before) == []


def _leftover_processes(before: set[str], timeout_s: float = 45.0) -> list[str]:
    """This process's descendants that were not there `before` the cluster started (Ray's
    daemons and workers) still alive after `timeout_s` (on a loaded 2-core machine a worker
    restarted after a kill has taken over 15 s to exit: late, not leaked; the wait ends as
    soon as none is left). A child an earlier test left for the whole run (multiprocessing's
    resource tracker, started by the first spawned pool) is not the cluster's."""
    deadline = time.monotonic() + timeout_s
    while (left := sorted(set(_descendants(os.getpid())) - before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _descendants(root: int) -> list[str]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        state, ppid = fields.split()[:2]
        if state != "Z":
            parents[int(stat.parent.name)] = (int(ppid), name.split("(", 1)[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in parents.items() if ppid == parent]
        found += [f"{pid} {parents[pid][1]}" for pid in children]
        frontier += children
    return found


def _clip(seed: int) -> bytes:
    """A 3 s, 12-frame 112x84 H.264 clip of its own content."""
    buffer = io.BytesIO()
    write_video(buffer, moving_texture(12, 112, 84, seed=seed), time_base=Fraction(1, 4))
    return buffer.getvalue()


def _clips_by_slot(first_seed: int, num_each: int) -> dict[str, list[bytes]]:
    """Clips whose keys prefer each of the two replicas' slots (ranks 0 and 1), as the
    documented rendezvous predicts (x264 may not make the same bytes twice, so the clips are
    sorted by their key, not chosen by seed)."""
    slots = {"rank-0": "rank-0", "rank-1": "rank-1"}
    clips: dict[str, list[bytes]] = {slot: [] for slot in slots}
    seed = first_seed
    while min(map(len, clips.values())) < num_each:
        clip = _clip(seed)
        slot = rendezvous_order(media_key(clip), slots)[0]
        if len(clips[slot]) < num_each:
            clips[slot].append(clip)
        seed += 1
    return clips


def _messages(clip: bytes, question: str = "What moves?") -> list[dict]:
    parts = [
        {"type": "video_url", "video_url": {"url": data_url(clip)}},
        {"type": "text", "text": question},
    ]
    return [{"role": "user", "content": parts}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0, timeout=120)


def _ask(url: str, clip: bytes, question: str = "What moves?", max_tokens: int = 4):
    return _client(url).chat.completions.create(
        model=None, messages=_messages(clip, question), max_tokens=max_tokens, temperature=0
    )


def _samples(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _per_replica(samples: dict, name: str) -> Counter:
    return Counter(
        {dict(labels)["replica"]: value for (n, labels), value in samples.items() if n == name}
    )


def _routed(url: str) -> Counter:
    return Counter(
        {
            (dict(labels)["replica"], dict(labels)["affinity"]): value
            for (name, labels), value in _samples(url).items()
            if name == ROUTED
        }
    )


def _routed_by(url: str, before: Counter, count: int) -> Counter:
    """The routing of the `count` requests finished since `before` was read."""
    deadline = time.monotonic() + SETTLE_S
    while (sum((delta := _routed(url) - before).values()) < count) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(delta.values()) == count, delta
    return delta


def _served_by(url: str, request) -> tuple[str, str, object]:
    """(replica, affinity, answer) of one request."""
    before = _routed(url)
    answer = request()
    ((replica, affinity),) = _routed_by(url, before, 1)
    return replica, affinity, answer


def test_answers_equal_a_single_server(cluster, main_server, tiny_clip):
    """Greedy answers through the ingress equal one process's, whatever the endpoint."""
    for url in (cluster, main_server.url):
        assert httpx.get(f"{url}/health").status_code == 200
    questions = [_messages(tiny_clip), [{"role": "user", "content": "Say something."}]]
    for messages in questions:
        answers = [
            _client(url).chat.completions.create(
                model=None, messages=messages, max_tokens=8, temperature=0
            )
            for url in (cluster, main_server.url)
        ]
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens
        streamed = _client(cluster).chat.completions.create(
            model=None, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == answers[1].choices[0].message.content
    form = {"prompt": "What moves?", "max_tokens": "8"}
    described = [
        httpx.post(
            f"{url}/v1/videos/describe",
            files={"file": ("clip.mp4", tiny_clip, "video/mp4")},
            data=form,
            timeout=120,
        )
        for url in (cluster, main_server.url)
    ]
    assert [r.status_code for r in described] == [200, 200]
    assert described[0].json()["token_ids"] == described[1].json()["token_ids"]
    assert described[0].json()["id"] == described[0].headers["x-request-id"]


def test_a_plan_through_the_ingress_equals_a_single_servers(cluster, main_server, tiny_clip):
    """The token plan answers at the ingress as on one process, the video sent as the body
    or named by a URL; a body over the upload limit is refused at the ingress."""
    query = {"num_frames": 4, "evs": json.dumps({"mode": "rate", "rate": 0.5})}
    headers = {"content-type": "video/mp4"}
    plans = [
        httpx.post(f"{url}/v1/videos/plan", params=query, content=tiny_clip, headers=headers)
        for url in (cluster, main_server.url)
    ]
    assert [response.status_code for response in plans] == [200, 200], plans[0].text
    ours, theirs = (response.json() for response in plans)
    assert ours["id"] == plans[0].headers["x-request-id"] and ours["object"] == "video.plan"
    assert len(ours["frame_times"]) == 4
    for varying in ("id", "created", "model"):
        del ours[varying], theirs[varying]
    assert ours == theirs
    by_url = httpx.post(f"{cluster}/v1/videos/plan", params={**query, "url": data_url(tiny_clip)})
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["frame_times"] == ours["frame_times"]
    too_big = b"\0" * (MAX_UPLOAD_BYTES + 1)
    response = httpx.post(f"{cluster}/v1/videos/plan", content=too_big, headers=headers)
    assert_error(response, 413, "payload_too_large", "exceeds the limit")


def test_a_second_question_meets_its_videos_caches_on_the_same_replica(cluster):
    clip = _clip(31)
    first_replica, first_affinity, _ = _served_by(cluster, lambda: _ask(cluster, clip))
    towers = _per_replica(_samples(cluster), "stillcut_vision_tower_passes_total")
    replica, affinity, second = _served_by(cluster, lambda: _ask(cluster, clip, "What color?"))
    assert (replica, affinity) == (first_replica, first_affinity) == (first_replica, "true")
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert _per_replica(_samples(cluster), "stillcut_vision_tower_passes_total") == towers


def test_different_videos_spread_over_both_replicas(cluster):
    """8 videos, 4 preferring each slot: each slot's videos meet on one replica, the two
    slots are the two replicas, and no video was diverted."""
    routes = {
        slot: {_route_of(cluster, clip) for clip in clips}
        for slot, clips in _clips_by_slot(60, 4).items()
    }
    assert [len(slot_routes) for slot_routes in routes.values()] == [1, 1], routes
    (replica_0, affinity_0), (replica_1, affinity_1) = (route for (route,) in routes.values())
    assert replica_0 != replica_1 and affinity_0 == affinity_1 == "true"


def _route_of(url: str, clip: bytes) -> tuple[str, str]:
    """(replica, affinity) of one short question about `clip`."""
    replica, affinity, _ = _served_by(url, lambda: _ask(url, clip, max_tokens=1))
    return replica, affinity


def test_a_hot_video_spills_onto_the_other_replica_past_the_margin(cluster):
    clip, num_clients = _clip(41), 12
    before = _routed(cluster)
    with ThreadPoolExecutor(num_clients) as pool:
        answers = list(pool.map(lambda _: _ask(cluster, clip, max_tokens=64), range(num_clients)))
    routed = _routed_by(cluster, before, num_clients)
    by_affinity = Counter({affinity: n for (_, affinity), n in routed.items()})
    assert len({replica for replica, _ in routed}) == 2, routed
    assert by_affinity["true"] > MARGIN and by_affinity["false"] >= 1, routed
    assert len({answer.choices[0].message.content for answer in answers}) == 1


def _frame_message(timestamp: float, frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return struct.pack("<d", timestamp) + buffer.getvalue()


def test_a_live_session_stays_on_one_replica(cluster):
    frames = np.random.default_rng(5).integers(0, 255, (8, 56, 84, 3), dtype=np.uint8)
    sessions_before = _sessions(_samples(cluster))
    before = _routed(cluster)
    url = cluster.replace("http://", "ws://") + "/v1/stream"
    with connect(url, proxy=None, subprotocols=["stillcut"]) as socket:
        assert socket.subprotocol == "stillcut"
        socket.send(json.dumps({"type": "start", "threshold": 0.1, "fps": 2, "max_tokens": 4}))
        assert json.loads(socket.recv(timeout=30))["type"] == "started"
        live = [
            report["live_sessions"] for report in httpx.get(f"{cluster}/health").json()["replicas"]
        ]
        assert sorted(live) == [0, 1]
        for k, frame in enumerate(frames):
            socket.send(_frame_message(k / 2, frame))
        events = [json.loads(socket.recv(timeout=60)) for _ in range(len(frames) // 2)]
        socket.send(json.dumps({"type": "ask", "prompt": "What changed?"}))
        while (message := json.loads(socket.recv(timeout=60)))["type"] != "answer":
            assert message["type"] == "token", message
        socket.send(json.dumps({"type": "stop"}))
    assert [event["type"] for event in events] == ["frame"] * 4
    ((replica, affinity),) = _routed_by(cluster, before, 1)
    assert affinity == "false"  # a session has no key: Ray's least-loaded of two placed it
    assert _sessions(_samples(cluster)) - sessions_before == Counter({replica: 1})


def _sessions(samples: dict) -> Counter:
    """Live sessions each replica has finished."""
    sessions = Counter()
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if name == "stillcut_requests_total" and labels["endpoint"] == "/v1/stream":
            sessions[labels["replica"]] += value
    return sessions


def test_the_ingress_applies_the_limits_before_any_replica_works(cluster):
    requests_before = sum(_per_replica(_samples(cluster), "stillcut_requests_total").values())
    too_big = b'{"messages": "' + b"x" * (2 * MAX_UPLOAD_BYTES + 2**20) + b'"}'
    response = httpx.post(
        f"{cluster}/v1/chat/completions",
        content=too_big,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert_error(response, 413, "payload_too_large", "exceeds the limit")
    response = httpx.get(f"{cluster}/v1/models", headers={"host": "evil.example"})
    assert_error(response, 400, "untrusted_host", "evil.example")
    response = httpx.get(f"{cluster}/v1/models", headers={"x-request-timeout": "soon"})
    assert_error(response, 400, "invalid_header", "x-request-timeout")
    requests_after = sum(_per_replica(_samples(cluster), "stillcut_requests_total").values())
    assert requests_after == requests_before  # refused at the ingress
    response = httpx.post(
        f"{cluster}/v1/chat/completions",
        content=b"[" * 100_000,
        headers={"content-type": "application/json"},
    )
    assert_error(response, 400, "json_too_deep", "64 levels")  # the replica's own answer


def test_health_metrics_and_the_page_are_served_at_the_ingress(cluster):
    page = httpx.get(f"{cluster}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    health = httpx.get(f"{cluster}/health").json()
    assert (health["status"], health["replicas_up"], health["replicas_total"]) == ("ok", 2, 2)
    assert health["kv_blocks_total"] == sum(r["kv_blocks_total"] for r in health["replicas"])
    replicas = {report["replica"] for report in health["replicas"]}
    samples = _samples(cluster)
    assert set(_per_replica(samples, "stillcut_kv_blocks_total")) == replicas
    assert samples["stillcut_replicas_up", frozenset()] == 2


def test_a_client_that_leaves_frees_its_replicas_work(cluster):
    """A client that gives up cancels its request through the proxy, the ingress and the
    replica (which logs it as 499, not as an answer sent), and every KV block comes back."""
    gone_before = sum(_replica_statuses(cluster)["499"].values())
    body = json.dumps({"messages": _messages(_clip(70)), "max_tokens": 1800, "temperature": 0})
    url = httpx.URL(cluster)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    deadline = time.monotonic() + 30
    # the client leaves once its request runs on a replica (a timeout fixed in advance raced
    # the tiny model, which can finish 1,800 tokens within a second)
    with socket.create_connection((url.host, url.port)) as client:
        client.sendall(head.encode() + body.encode())
        while not httpx.get(f"{cluster}/health").json()["requests_running"]:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
    while sum(_replica_statuses(cluster)["499"].values()) == gone_before:
        assert time.monotonic() < deadline, "the replica never saw the client leave"
        time.sleep(0.2)
    while (health := httpx.get(f"{cluster}/health").json())["requests_running"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    assert health["kv_blocks_used"] == 0


def _replica_statuses(url: str) -> dict[str, Counter]:
    """Chat requests each replica finished, by status."""
    statuses: dict[str, Counter] = {}
    for (name, labels), value in _samples(url).items():
        labels = dict(labels)
        if name == "stillcut_requests_total" and labels["endpoint"] == "/v1/chat/completions":
            statuses.setdefault(labels["status"], Counter())[labels["replica"]] += value
    return {"499": Counter(), **statuses}


def _stream_outcome(url: str, clip: bytes) -> str:
    """How a streamed chat request ended: "done", or the code of the error event that ended
    it (or of its 503, when it failed before its stream opened)."""
    body = {"messages": _messages(clip), "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return _failure(response)
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    return last["error"]["code"] if "error" in last else "done"


def _answer_outcome(url: str, clip: bytes, max_tokens: int) -> str:
    body = {"messages": _messages(clip), "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    return "done" if response.status_code == 200 else _failure(response)


def _failure(response: httpx.Response) -> str:
    assert_error(response, 503, "replica_failed", "retry")
    assert response.headers["retry-after"] == "1"
    return "replica_failed"


def test_a_killed_replica_fails_only_its_requests_and_is_restarted(cluster):
    clips = _clips_by_slot(80, 1)
    clip_x, clip_y = clips["rank-0"][0], clips["rank-1"][0]  # keys of different replicas
    x, _, _ = _served_by(cluster, lambda: _ask(cluster, clip_x, max_tokens=1))
    y, _, _ = _served_by(cluster, lambda: _ask(cluster, clip_y, max_tokens=1))
    assert x != y
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, APP_NAME)
    pids = dict(handle.broadcast("process_id").results(timeout_s=30))
    with contextlib.ExitStack() as sockets, ThreadPoolExecutor(8) as pool:
        sessions = [sockets.enter_context(_started_session(cluster)) for _ in range(2)]
        reports = httpx.get(f"{cluster}/health").json()["replicas"]
        sessions_on_x = sum(r["live_sessions"] for r in reports if r["replica"] == x)
        on_x = [pool.submit(_stream_outcome, cluster, clip_x) for _ in range(3)]
        on_x += [pool.submit(_answer_outcome, cluster, clip_x, 1500) for _ in range(3)]
        on_y = [pool.submit(_answer_outcome, cluster, clip_y, 200) for _ in range(2)]
        deadline = time.monotonic() + 30
        while not _running_on(cluster, x) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pids[x], signal.SIGKILL)
        outcomes_x = Counter(future.result(timeout=120) for future in on_x)
        outcomes_y = [future.result(timeout=120) for future in on_y]
        session_outcomes = Counter(_session_outcome(socket) for socket in sessions)
    assert session_outcomes == Counter(
        {"replica_failed": sessions_on_x, "stopped": 2 - sessions_on_x}
    )
    assert outcomes_x["replica_failed"] >= 1 and set(outcomes_x) <= {"done", "replica_failed"}
    assert outcomes_y == ["done", "done"]
    for clip in (clip_x, clip_y, _clip(90), _clip(91)):  # later requests: all answered, fast
        started = time.monotonic()
        assert _ask(cluster, clip, max_tokens=2).choices[0].finish_reason == "length"
        assert time.monotonic() - started < 60
    deadline = time.monotonic() + 120
    while httpx.get(f"{cluster}/health").json()["replicas_up"] < 2:
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(0.5)
    restarted = dict(handle.broadcast("process_id").results(timeout_s=30))
    assert pids[x] not in restarted.values() and restarted[y] == pids[y]
    replica, affinity, _ = _served_by(cluster, lambda: _ask(cluster, clip_x, max_tokens=1))
    assert replica not in pids and affinity == "true"  # its keys went back to its successor


@contextlib.contextmanager
def _started_session(url: str):
    with connect(url.replace("http://", "ws://") + "/v1/stream", proxy=None) as socket:
        socket.send(json.dumps({"type": "start", "max_tokens": 4}))
        assert json.loads(socket.recv(timeout=30))["type"] == "started"
        yield socket


def _session_outcome(socket) -> str:
    """ "replica_failed" for a session that got that error and close code 1011; "stopped"
    for one still open, which then stops normally."""
    try:
        message = json.loads(socket.recv(timeout=2))
    except TimeoutError:
        socket.send(json.dumps({"type": "stop"}))
        with pytest.raises(ConnectionClosedOK):
            socket.recv(timeout=30)
        return "stopped"
    assert (message["type"], message["code"]) == ("error", "replica_failed"), message
    with pytest.raises(ConnectionClosedError) as closed:
        socket.recv(timeout=30)
    assert closed.value.rcvd.code == 1011
    return "replica_failed"


def _running_on(url: str, replica: str) -> bool:
    reports = httpx.get(f"{url}/health").json()["replicas"]
    return any(r["replica"] == replica and r["requests_running"] >= 2 for r in reports)
