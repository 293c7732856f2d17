"""`stillcut serve`: the HTTP service (REST describe, OpenAI chat, live WebSocket, metrics).

Listens on 127.0.0.1 unless told otherwise: exposing it is a decision, best made together with
`--api-key` (or `STILLCUT_API_KEY`, which keeps the key out of the process list) and
`--trusted-hosts` (the names clients reach it by; by default the local names and `--host`).
With `--replicas N` the model runs in N engine replicas on Ray Serve behind one ingress
(`stillcut.service.cluster`, the `cluster` extra); without it, nothing of Ray is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used, so `stillcut --help` stays instant
    from stillcut.engine.config import EngineConfig
    from stillcut.service.cluster.launch import ClusterConfig
    from stillcut.service.cluster.replica import ReplicaSpec
    from stillcut.service.config import ServerConfig
    from stillcut.vision.decode import DecodeConfig

from stillcut.engine.config import DEFAULT_SNAPSHOT_INTERVAL
from stillcut.service.reasoning import REASONING_PARSERS

API_KEY_ENV = "STILLCUT_API_KEY"
DEFAULT_PREFILL_CHUNK = 512
WILDCARD_ADDRESSES = ("0.0.0.0", "::")


def add_parser(commands: argparse._SubParsersAction) -> None:
    from stillcut.service.cli_options import (
        add_evs_arguments,
        add_precision_arguments,
        add_speculative_arguments,
    )

    parser = commands.add_parser("serve", help="run the HTTP service")
    parser.set_defaults(run=run)
    parser.add_argument("--model", help="checkpoint folder or hub id (default: the demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default local)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every request but /health "
        f"(default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument("--media-dir", type=Path, help="folder file:// URLs may read from")
    parser.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated hosts http(s) media URLs may name (default: none)",
    )
    parser.add_argument(
        "--trusted-hosts",
        help="comma-separated names the Host header may carry, or '*' (default: localhost, "
        "127.0.0.1, ::1 and --host unless it is 0.0.0.0 or ::)",
    )
    parser.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated browser origins besides the server's own, or '*' (default: none)",
    )
    parser.add_argument(
        "--max-upload-mb", type=float, default=64, help="largest upload or media URL (default 64)"
    )
    parser.add_argument(
        "--limit-frames",
        type=int,
        default=4096,
        help="most frames a video may sample (default 4096)",
    )
    parser.add_argument(
        "--limit-fps", type=float, default=8, help="highest sampling rate asked for (default 8)"
    )
    parser.add_argument(
        "--limit-mm-per-prompt", type=int, default=8, help="media parts per request (default 8)"
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=4096 * 4096,
        help="largest image, width x height (default 4096 x 4096)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30,
        help="seconds a request body may take to arrive before 408 (default 30)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="open connections before new requests get 503 (default 256)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait before 503 (default 64)"
    )
    parser.add_argument(
        "--kv-cache-memory", type=int, default=256, help="KV cache size in MiB (default 256)"
    )
    parser.add_argument(
        "--mamba-snapshot-interval",
        type=int,
        default=DEFAULT_SNAPSHOT_INTERVAL,
        help="hybrid models: save the recurrent state every N full KV blocks for the prefix "
        f"cache, besides at the ends of prompts and media (default {DEFAULT_SNAPSHOT_INTERVAL})",
    )
    parser.add_argument("--max-model-len", type=int, default=32768, help="context length")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests run at once")
    parser.add_argument(
        "--max-prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help="most prompt tokens one request prefills per step, so a long prompt shares each "
        f"step with other requests (default {DEFAULT_PREFILL_CHUNK}; 0: the whole step budget)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly: no CUDA graphs for decode or the vision encoder",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600, help="longest a request may take, seconds"
    )
    parser.add_argument(
        "--max-sessions", type=int, default=4, help="live WebSocket sessions at once (default 4)"
    )
    parser.add_argument(
        "--session-idle",
        type=float,
        default=60,
        help="seconds a live session may send nothing before it is closed (default 60)",
    )
    add_evs_arguments(parser)
    add_speculative_arguments(parser)
    add_precision_arguments(parser)
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split a leading <think>...</think> of chat answers into reasoning_content",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    add_cluster_arguments(parser)


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """`--replicas` and what goes with it (`pip install 'stillcut[cluster]'`)."""
    cluster = parser.add_argument_group("replicas on Ray Serve")
    cluster.add_argument(
        "--replicas", type=int, help="run N engine replicas on Ray Serve behind one ingress"
    )
    cluster.add_argument(
        "--ray-address", help="join this Ray cluster ('auto', HOST:6379; default: a local one)"
    )
    cluster.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=1.0,
        help="CPUs reserved per replica, and its threads rounded up (default 1)",
    )
    cluster.add_argument(
        "--num-gpus-per-replica", type=float, default=0.0, help="GPUs per replica (default 0)"
    )
    cluster.add_argument(
        "--affinity-margin",
        type=int,
        default=4,
        help="requests a video's replica may have in flight beyond the least-loaded one "
        "before its requests go there instead (default 4)",
    )


def run(args: argparse.Namespace) -> int:
    from stillcut.service.api import VideoLLM
    from stillcut.service.cli_options import RANDOM_WEIGHTS_NOTICE, evs_config
    from stillcut.service.server import serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.replicas is not None:
        serve_cluster = _cluster_launcher()
        spec, cluster = cluster_settings(args)
        serve_cluster(spec, cluster, host=args.host, port=args.port)
        return 0
    _check_no_cluster_flags(args)
    config, engine_config, decode_config = server_settings(args)
    llm = VideoLLM(
        args.model,
        engine_config=engine_config,
        decode_config=decode_config,
        evs=evs_config(args),
    )
    if llm.is_random_demo:
        logging.getLogger("stillcut.service").warning(RANDOM_WEIGHTS_NOTICE)
    serve(llm, config, host=args.host, port=args.port)
    return 0


def server_settings(
    args: argparse.Namespace,
) -> tuple[ServerConfig, EngineConfig, DecodeConfig]:
    """The flags' `ServerConfig`, `EngineConfig` and `DecodeConfig`."""
    from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stillcut.service.cli_options import precision_options, speculative_config
    from stillcut.service.config import MIB, ServerConfig
    from stillcut.vision.decode import DecodeConfig

    config = ServerConfig(
        api_key=args.api_key,
        media_dir=args.media_dir,
        allowed_hosts=_names(args.allowed_hosts),
        trusted_hosts=_trusted_hosts(args.trusted_hosts, args.host),
        allowed_origins=_names(args.allowed_origins),
        max_upload_bytes=int(args.max_upload_mb * MIB),
        max_queue=args.max_queue,
        max_connections=args.max_connections,
        body_timeout_s=args.body_timeout,
        request_timeout_s=args.request_timeout,
        limit_frames=args.limit_frames,
        limit_fps=args.limit_fps,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        max_sessions=args.max_sessions,
        session_idle_s=args.session_idle,
        reasoning_parser=args.reasoning_parser,
    )
    engine_config = EngineConfig(
        enforce_eager=args.enforce_eager,
        scheduler=SchedulerConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_prefill_tokens_per_request=args.max_prefill_chunk or None,
        ),
        cache=CacheConfig(
            kv_cache_memory=args.kv_cache_memory * MIB,
            mamba_snapshot_interval=args.mamba_snapshot_interval,
        ),
        speculative=speculative_config(args),
        **precision_options(args),
    )
    return config, engine_config, DecodeConfig(max_image_pixels=args.max_image_pixels)


def cluster_settings(args: argparse.Namespace) -> tuple[ReplicaSpec, ClusterConfig]:
    """With `--replicas N`: the `ReplicaSpec` every replica loads and the `ClusterConfig`."""
    from stillcut.demo import demo_checkpoint
    from stillcut.service.api import DEMO_MODEL_NAME
    from stillcut.service.cli_options import evs_config
    from stillcut.service.cluster.launch import ClusterConfig
    from stillcut.service.cluster.replica import ReplicaSpec

    cluster = ClusterConfig(
        num_replicas=args.replicas,
        ray_address=args.ray_address,
        num_cpus_per_replica=args.num_cpus_per_replica,
        num_gpus_per_replica=args.num_gpus_per_replica,
        affinity_margin=args.affinity_margin,
    )
    model = args.model
    if model is None and args.ray_address is None:  # built once here, not by every replica
        model = str(demo_checkpoint())
    config, engine_config, decode_config = server_settings(args)
    if args.num_gpus_per_replica > 0:  # Ray shows each replica only its own share of GPUs
        engine_config = dataclasses.replace(engine_config, device="cuda")
    spec = ReplicaSpec(
        model=model,
        name=None if args.model else DEMO_MODEL_NAME,
        server=config,
        engine_config=engine_config,
        decode_config=decode_config,
        evs=evs_config(args),
        num_cpus=args.num_cpus_per_replica,
        log_level=args.log_level,
    )
    return spec, cluster


def _cluster_launcher():
    """`launch.serve_cluster`, or an error that names the extra when Ray is not installed."""
    try:
        from stillcut.service.cluster.launch import serve_cluster
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "ray":
            raise
        raise ValueError(
            "--replicas needs Ray Serve, which is not installed: pip install 'stillcut[cluster]'"
        ) from None
    return serve_cluster


def _check_no_cluster_flags(args: argparse.Namespace) -> None:
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --replicas N")


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated flag's entries."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _trusted_hosts(flag: str | None, host: str) -> tuple[str, ...]:
    """`--trusted-hosts`, else the local names plus the address listened on (a wildcard
    address is no name a client uses)."""
    from stillcut.service.config import LOCAL_HOSTS

    if flag is not None:
        return _names(flag)
    listened = () if host in WILDCARD_ADDRESSES else (host.strip("[]"),)
    return tuple(dict.fromkeys((*LOCAL_HOSTS, *listened)))
