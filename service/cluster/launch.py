"""Starting the service on Ray Serve: a local Ray instance or an existing cluster, N engine
replicas, one ingress, Ray's HTTP proxy on the service's address.

Ray's proxy serves `host:port`; behind it the ingress (no CPU reserved) holds the service's
app and a handle to the engine replicas, whose `MediaAffinityRouter` places requests. The
proxy's own deadline sits past the service's (`--request-timeout` plus `--body-timeout`, or
a live session's `max_session_s`), so the service's 408, 504 and session limits answer first;
its idle keep-alive closes after `--body-timeout`. Shutting down a local instance ends every
process it started, orphans of its raylet included (`processes`). At most `--max-connections`
requests and sessions are at the ingress at once and as many wait at the proxy; past that, the proxy
answers 503. A replica may take `3 × max_queue + max_num_seqs + 2 × max_sessions` calls at
once, so its own queue limits (503 `queue_full`) answer before Ray's.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig
from ray.serve.schema import LoggingConfig

from stillcut.service.cluster.ingress import Ingress
from stillcut.service.cluster.processes import Process, descendants, reap, start_watcher
from stillcut.service.cluster.replica import EngineReplica, ReplicaSpec
from stillcut.service.cluster.router import DEFAULT_MARGIN, MediaAffinityRouter
from stillcut.service.config import ServerConfig

APP_NAME = "stillcut"
REPLICA_DEPLOYMENT = "EngineReplica"
HEALTH_CHECK_PERIOD_S = 2.0
PROXY_GRACE_S = 5.0
ORPHAN_GRACE_S = 5.0  # after Ray's own shutdown: then what it left running is killed
logger = logging.getLogger("stillcut.service")


@dataclass(frozen=True)
class ClusterConfig:
    """How the service spreads over Ray: the replicas, their resources, the routing."""

    num_replicas: int
    ray_address: str | None = None  # an existing cluster ("auto", "HOST:6379"); None: local
    num_cpus_per_replica: float = 1.0  # reserved per replica; its torch threads, rounded up
    num_gpus_per_replica: float = 0.0
    # False: Ray Serve's default router for every request, a baseline to compare with (it
    # cannot pin a live session's frames to its replica, so sessions need affinity on)
    affinity: bool = True
    affinity_margin: int = DEFAULT_MARGIN  # requests in flight beyond the least-loaded
    num_cpus: int | None = None  # a local instance's CPUs (None: the machine's)

    def __post_init__(self) -> None:
        counts = (("num_replicas", 1), ("affinity_margin", 0), ("num_cpus", 1))
        for name, least in counts:
            value = getattr(self, name)
            if name == "num_cpus" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")
        cpus, gpus = self.num_cpus_per_replica, self.num_gpus_per_replica
        if not (math.isfinite(cpus) and cpus > 0):
            raise ValueError(f"num_cpus_per_replica={cpus!r} must be a finite number > 0")
        if not (math.isfinite(gpus) and gpus >= 0):
            raise ValueError(f"num_gpus_per_replica={gpus!r} must be a finite number >= 0")
        if self.ray_address is not None and self.num_cpus is not None:
            raise ValueError("num_cpus sizes a local Ray instance; a cluster has its own")


def deploy(
    spec: ReplicaSpec, cluster: ClusterConfig, *, host: str, port: int, log_to_driver: bool = True
) -> None:
    """Start (or join) Ray and Serve's proxy on `host:port`, deploy the replicas and the
    ingress; returns once every replica is ready."""
    local = cluster.ray_address is None
    ray.init(
        address="local" if local else cluster.ray_address,
        num_cpus=cluster.num_cpus,
        include_dashboard=False if local else None,
        log_to_driver=log_to_driver,
    )
    _check_resources(cluster, local)
    config = spec.server
    serve.start(
        http_options=HTTPOptions(
            host=host,
            port=port,
            request_timeout_s=_proxy_timeout_s(config),
            keep_alive_timeout_s=max(1, math.ceil(config.body_timeout_s)),
        ),
        logging_config=LoggingConfig(enable_access_log=False),
    )
    serve.run(_application(spec, cluster), name=APP_NAME, route_prefix="/")


def shutdown(
    cluster: ClusterConfig, existing: list[Process] = (), deployed: list[Process] = ()
) -> None:
    """Remove the service; a local Ray instance goes too, with every process of this one's
    started since `existing` were noted; a cluster keeps running. `deployed` are this
    process's descendants noted once the service was up: a signal may have ended the raylet
    (orphaning its agents, which then are no descendants) before this runs."""
    local = cluster.ray_address is None
    now = descendants(os.getpid()) if local else []
    started = [p for p in dict.fromkeys([*deployed, *now]) if p not in existing]
    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()
    finally:  # a shutdown that fails part-way leaves the most orphans behind
        left = reap(started, ORPHAN_GRACE_S)
        if left:
            logger.warning("killed %d process(es) Ray left running: %s", len(left), left)


def serve_cluster(spec: ReplicaSpec, cluster: ClusterConfig, *, host: str, port: int) -> None:
    """`stillcut serve --replicas N`: serve until interrupted (Ctrl-C or SIGTERM)."""
    stop = threading.Event()
    existing = descendants(os.getpid())
    if cluster.ray_address is None:  # what a local Ray instance starts goes with this process
        start_watcher(existing, ORPHAN_GRACE_S)
    try:
        deploy(spec, cluster, host=host, port=port)
    except BaseException:
        shutdown(cluster, existing)
        raise
    deployed = descendants(os.getpid())
    # after `ray.init`, which sets its own SIGTERM handler (an exit at any point)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        logger.info("serving on http://%s:%d with %d replicas", host, port, cluster.num_replicas)
        stop.wait()
    finally:
        shutdown(cluster, existing, deployed)


@contextmanager
def running_cluster(spec: ReplicaSpec, cluster: ClusterConfig) -> Iterator[str]:
    """The service on a free port of 127.0.0.1 for the block (tests, benchmarks); its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    existing = descendants(os.getpid())
    deployed: list[Process] = []
    try:
        deploy(spec, cluster, host="127.0.0.1", port=port, log_to_driver=False)
        deployed = descendants(os.getpid())
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown(cluster, existing, deployed)


def _application(spec: ReplicaSpec, cluster: ClusterConfig):
    config, scheduler = spec.server, spec.engine_config.scheduler
    replica_calls = 3 * config.max_queue + scheduler.max_num_seqs + 2 * config.max_sessions
    replicas = serve.deployment(
        EngineReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=cluster.num_replicas,
        ray_actor_options={
            "num_cpus": cluster.num_cpus_per_replica,
            "num_gpus": cluster.num_gpus_per_replica,
        },
        max_ongoing_requests=replica_calls,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=config.shutdown_timeout_s + PROXY_GRACE_S,
        request_router_config=_router_config(cluster),
    )
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=config.max_connections,
        max_queued_requests=config.max_connections,
    )
    return ingress.bind(replicas.bind(spec), config, cluster.num_replicas, spec.log_level)


def _router_config(cluster: ClusterConfig) -> RequestRouterConfig:
    if not cluster.affinity:
        return RequestRouterConfig()  # Ray Serve's default: power of two choices, FIFO
    return RequestRouterConfig(
        request_router_class=MediaAffinityRouter,
        request_router_kwargs={"margin": cluster.affinity_margin},
    )


def _proxy_timeout_s(config: ServerConfig) -> float:
    longest = max(config.request_timeout_s + config.body_timeout_s, config.max_session_s)
    return longest + PROXY_GRACE_S


def _check_resources(cluster: ClusterConfig, local: bool) -> None:
    """Refuse (local) or warn about (a cluster, which may grow) replicas that cannot fit."""
    have = ray.cluster_resources()
    for resource, each in (
        ("CPU", cluster.num_cpus_per_replica),
        ("GPU", cluster.num_gpus_per_replica),
    ):
        need = cluster.num_replicas * each
        if need > have.get(resource, 0.0) + 1e-9:
            message = (
                f"{cluster.num_replicas} replicas x {each:g} {resource} need {need:g} {resource}; "
                f"the Ray instance has {have.get(resource, 0.0):g}"
            )
            if local:
                ray.shutdown()
                raise ValueError(message)
            logger.warning("%s: replicas will wait for resources", message)
