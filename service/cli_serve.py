"""`stillcut serve`: the HTTP service (REST describe, OpenAI chat, live WebSocket, metrics).

Listens on 127.0.0.1 unless told otherwise: exposing it is a decision, best made together with
`--api-key` (or `STILLCUT_API_KEY`, which keeps the key out of the process list) and
`--trusted-hosts` (the names clients reach it by; by default the local names and `--host`).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from stillcut.service.reasoning import REASONING_PARSERS

API_KEY_ENV = "STILLCUT_API_KEY"
WILDCARD_ADDRESSES = ("0.0.0.0", "::")


def add_parser(commands: argparse._SubParsersAction) -> None:
    from stillcut.service.cli import add_evs_arguments, add_precision_arguments

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
        "--limit-frames", type=int, default=256, help="most frames a video may sample (default 256)"
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
    parser.add_argument("--max-model-len", type=int, default=32768, help="context length")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests run at once")
    parser.add_argument(
        "--request-timeout", type=float, default=600, help="longest a request may take, seconds"
    )
    parser.add_argument(
        "--max-sessions", type=int, default=4, help="live WebSocket sessions at once (default 4)"
    )
    add_evs_arguments(parser)
    add_precision_arguments(parser)
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split a leading <think>...</think> of chat answers into reasoning_content",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))


def run(args: argparse.Namespace) -> int:
    from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stillcut.service.api import VideoLLM
    from stillcut.service.cli import RANDOM_WEIGHTS_NOTICE, evs_config, precision_options
    from stillcut.service.config import MIB, ServerConfig
    from stillcut.service.server import serve
    from stillcut.vision.decode import DecodeConfig

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
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
        reasoning_parser=args.reasoning_parser,
    )
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory * MIB),
        **precision_options(args),
    )
    decode_config = DecodeConfig(max_image_pixels=args.max_image_pixels)
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
