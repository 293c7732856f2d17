"""`stillcut describe VIDEO`: answer a prompt about a video and show what it cost.

Prints the answer, then what EVS kept, the token counts and where the time went (or, with
`--json`, the whole `DescribeResult` as one object). Progress bars on stderr follow decoding,
encoding and generation. With a random-weight checkpoint (the factory's presets) a one-line
notice says so: the words mean nothing while the pipeline and the EVS numbers are real.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_MAX_TOKENS = 128


def add_parser(commands: argparse._SubParsersAction) -> None:
    from stillcut.service.cli_options import (
        add_precision_arguments,
        add_speculative_arguments,
        add_video_arguments,
    )

    parser = commands.add_parser("describe", help="answer a prompt about a video")
    parser.set_defaults(run=run)
    add_video_arguments(parser)
    add_precision_arguments(parser)
    parser.add_argument(
        "--prompt", default="Describe this video.", help="the question (default: describe it)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, help="seed for sampling with temperature > 0")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_speculative_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from stillcut.service.api import DEFAULT_ENGINE_CONFIG, VideoLLM
    from stillcut.service.cli_options import (
        RANDOM_WEIGHTS_NOTICE,
        check_video_command,
        evs_config,
        precision_options,
        speculative_config,
        video_options,
    )
    from stillcut.vision.decode import DecodeConfig

    check_video_command(args)
    decode_config = DecodeConfig(fps=args.fps, max_frames=args.max_frames, resize=args.resize)
    started = time.perf_counter()
    engine_config = replace(DEFAULT_ENGINE_CONFIG, speculative=speculative_config(args))
    llm = VideoLLM(
        args.model,
        engine_config=engine_config,
        decode_config=decode_config,
        evs=evs_config(args),
        **precision_options(args),
    )
    load_s = time.perf_counter() - started
    result = llm.describe(
        args.video,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        **video_options(args),
        max_video_tokens=args.max_video_tokens,
        progress=True,
    )
    memory = llm.engine.memory
    if args.json:
        report = {"video": str(args.video), "model": llm.name, "load_model_s": load_s}
        weights = {"weight_format": memory.weight_format, "weight_bytes": memory.weight_bytes}
        weights["arithmetic"] = memory.arithmetic.to_dict()
        report["memory"] = {
            **weights,
            "vision_weight_bytes": llm.vision_weight_bytes,
            "kv_cache_dtype": memory.kv_cache_dtype,
            "kv_cache_bytes": memory.kv_cache_bytes,
        }
        print(json.dumps({**report, **result.to_dict()}, indent=2))
    else:
        _print_result(result, load_s)
        print(f"{'weights':<12}{memory}; vision tower {llm.vision_weight_bytes / 2**20:.1f} MiB")
    if llm.is_random_demo:
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    return 0


def _print_result(result, load_s: float) -> None:
    evs, usage, timings = result.evs, result.usage, result.timings
    kept_share = evs.tokens_after / evs.tokens_before if evs.tokens_before else 1.0
    times = {"load model": load_s, **{k.removesuffix("_s"): v for k, v in vars(timings).items()}}
    lines = [
        (
            "EVS",
            f"{evs.setting}: kept {evs.tokens_after} of {evs.tokens_before} video tokens "
            f"({kept_share:.0%}) from {evs.frames} frames",
        ),
        ("per tubelet", " ".join(str(n) for n in evs.kept_per_tubelet)),
        (
            "tokens",
            f"prompt {usage.prompt_tokens} ({usage.cached_tokens} cached), generated "
            f"{usage.completion_tokens}, finish: {result.finish_reason}",
        ),
        ("timings", ", ".join(f"{name} {value:.3f} s" for name, value in times.items())),
    ]
    print(result.text.strip() or "(no text)")
    print()
    for label, value in lines:
        print(f"{label:<12}{value}")
