"""`stillcut summarize VIDEO`: a long video captioned chunk by chunk with times, then summarised.

Prints the timeline (one line per chunk: its times and caption), the summary, the answers to
`--ask` questions about when something happens, and what it cost (or, with `--json`, the whole
`VideoSummary` as one object). Bars on stderr follow the chunks and the aggregation rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(commands: argparse._SubParsersAction) -> None:
    from stillcut.service.cli_options import add_precision_arguments, add_video_arguments

    parser = commands.add_parser(
        "summarize", help="caption a long video chunk by chunk with times, then summarise it"
    )
    parser.set_defaults(run=run)
    add_video_arguments(parser, frame_caps=False)
    add_precision_arguments(parser)
    parser.add_argument(
        "--chunk-s",
        type=float,
        help="seconds per chunk (default: the longest that fits the context and token limits, "
        "at most what the checkpoint was trained on)",
    )
    parser.add_argument(
        "--overlap-s", type=float, default=0.0, help="seconds neighbouring chunks share"
    )
    parser.add_argument(
        "--ask",
        action="append",
        default=[],
        metavar="QUESTION",
        help='a question about when something happens ("when does the red square appear?"), '
        "answered from the timeline; may repeat",
    )
    parser.add_argument("--no-summary", action="store_true", help="the timeline only")
    parser.add_argument(
        "--caption-tokens", type=int, default=128, help="most tokens per caption (default 128)"
    )
    parser.add_argument(
        "--summary-tokens", type=int, default=256, help="most tokens per summary (default 256)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from stillcut.service.api import VideoLLM
    from stillcut.service.cli_options import (
        RANDOM_WEIGHTS_NOTICE,
        check_video_command,
        evs_config,
        precision_options,
        video_options,
    )
    from stillcut.vision.decode import DecodeConfig
    from stillcut.vision.summary.summarize import SummaryOptions
    from stillcut.vision.summary.when import check_when_question

    check_video_command(args)
    options = {
        "chunk_s": args.chunk_s,
        "overlap_s": args.overlap_s,
        "caption_tokens": args.caption_tokens,
        "summary_tokens": args.summary_tokens,
        "summarize": not args.no_summary,
    }
    SummaryOptions(**options)  # refuse a bad value before the model loads
    for question in args.ask:
        check_when_question(question)
    started = time.perf_counter()
    evs = evs_config(args)  # a flag's setting applies to every chunk as given
    llm = VideoLLM(
        args.model,
        decode_config=DecodeConfig(fps=args.fps, resize=args.resize),
        evs=evs,
        **precision_options(args),
    )
    load_s = time.perf_counter() - started
    video = video_options(args)
    summary = llm.summarize(
        args.video,
        questions=args.ask,
        evs=evs,
        progress=True,
        **options,
        fps=args.fps,
        start=video["start"],
        end=video["end"],
        pixels=dict(video["pixels"]),
        max_video_tokens=args.max_video_tokens,
    )
    if args.json:
        report = {"video": str(args.video), "model": llm.name, "load_model_s": load_s}
        print(json.dumps({**report, **summary.to_dict()}, indent=2))
    else:
        _print_summary(summary, load_s, with_summary=not args.no_summary)
    if llm.is_random_demo:
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    return 0


def _print_summary(summary, load_s: float, *, with_summary: bool) -> None:
    for entry in summary.timeline:
        print(f"[{entry.start_s:7.1f}-{entry.end_s:7.1f}s] {entry.text or '(no caption)'}")
    if with_summary:
        print(f"\nSummary: {summary.summary or '(empty)'}")
    for answer in summary.answers:
        print(f"\nQ: {answer.question}\nA: {answer.text}")
    usage, timings = summary.usage, summary.timings
    rate = usage.num_chunks / timings.total_s if timings.total_s else 0.0
    lines = [
        (
            "chunks",
            f"{usage.num_chunks} of {summary.chunk_s:g} s (overlap {summary.overlap_s:g} s), "
            f"{usage.num_cached_chunks} from the encoder cache; EVS {summary.evs}"
            f"{_whole(usage.num_whole_chunks)}: kept "
            f"{usage.video_tokens_after} of {usage.video_tokens_before} video tokens",
        ),
        (
            "tokens",
            f"prompt {usage.prompt_tokens} ({usage.cached_tokens} cached), generated "
            f"{usage.completion_tokens} in {usage.num_requests} requests; "
            f"{summary.num_rounds} aggregation round(s)",
        ),
        (
            "timings",
            f"load model {load_s:.2f} s, decode {timings.decode_s:.2f} s, encode "
            f"{timings.preprocess_s + timings.encode_s:.2f} s, captions {timings.caption_s:.2f} s"
            f", aggregate {timings.aggregate_s:.2f} s, total {timings.total_s:.2f} s "
            f"({rate:.1f} chunks/s)",
        ),
    ]
    print()
    for label, value in lines:
        print(f"{label:<12}{value}")


def _whole(count: int) -> str:
    return f" ({count} short chunk(s) kept whole)" if count else ""
