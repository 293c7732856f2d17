"""`stillcut serve`: the HTTP service (REST describe, OpenAI chat, live WebSocket, metrics).

Listens on 127.0.0.1 unless told otherwise: exposing it is a decision, best made together with
`--api-key` (or `STILLCUT_API_KEY`, which keeps the key out of the process list).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from stillcut.service.reasoning import REASONING_PARSERS

API_KEY_ENV = "STILLCUT_API_KEY"


def add_parser(commands: argparse._SubParsersAction) -> None:
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
        "--max-upload-mb", type=float, default=64, help="largest upload or media URL (default 64)"
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
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split a leading <think>...</think> of chat answers into reasoning_content",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))


def run(args: argparse.Namespace) -> int:
    from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stillcut.service.api import VideoLLM
    from stillcut.service.cli import RANDOM_WEIGHTS_NOTICE
    from stillcut.service.config import MIB, ServerConfig
    from stillcut.service.server import serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    config = ServerConfig(
        api_key=args.api_key,
        media_dir=args.media_dir,
        allowed_hosts=tuple(host for host in args.allowed_hosts.split(",") if host.strip()),
        max_upload_bytes=int(args.max_upload_mb * MIB),
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        max_sessions=args.max_sessions,
        reasoning_parser=args.reasoning_parser,
    )
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory * MIB),
    )
    llm = VideoLLM(args.model, engine_config=engine_config)
    if llm.is_random_demo:
        logging.getLogger("stillcut.service").warning(RANDOM_WEIGHTS_NOTICE)
    serve(llm, config, host=args.host, port=args.port)
    return 0
