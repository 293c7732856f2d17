"""`stillcut narrate VIDEO`: running commentary on a video, printed segment by segment.

Describe's names for the shared options; EVS is threshold mode (the live default; after the
tower, or before it with `--evs-stage pixels`) or off: there is no `--evs-rate`, since rate
mode ranks the whole clip and a narration sees it only as it comes. `--realtime` paces frames
at their timestamps (then `--lag latest` may skip).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    from stillcut.service.cli_options import add_compute_dtype_argument, add_evs_arguments

    parser = commands.add_parser("narrate", help="narrate a video as it plays")
    parser.set_defaults(run=run)
    parser.add_argument("video", type=Path, help="a video file")
    parser.add_argument("--model", help="checkpoint folder or hub id (default: the demo model)")
    parser.add_argument("--prompt", help="the instruction (default: narrate, line by line)")
    parser.add_argument("--fps", type=float, default=2.0, help="sampling rate (default 2)")
    add_evs_arguments(parser, rate=False)
    parser.add_argument(
        "--max-tokens-per-segment", type=int, default=24, help="segment cap (default 24)"
    )
    parser.add_argument(
        "--lag",
        choices=("queue", "latest"),
        default="queue",
        help="when the model falls behind: 'queue' narrates every tubelet in order, 'latest' "
        "skips to the newest (default queue)",
    )
    parser.add_argument("--realtime", action="store_true", help="pace frames at their times")
    add_compute_dtype_argument(parser)


def run(args: argparse.Namespace) -> int:
    from stillcut.service.api import DEFAULT_NARRATE_PROMPT, VideoLLM
    from stillcut.service.cli_options import (
        RANDOM_WEIGHTS_NOTICE,
        check_video_command,
    )

    check_video_command(args)
    options = {
        "fps": args.fps,
        "lag": args.lag,
        "max_tokens_per_segment": args.max_tokens_per_segment,
    }
    if args.no_evs or args.evs_threshold is not None:  # else the stage's default threshold
        options["threshold"] = None if args.no_evs else args.evs_threshold
    if args.evs_stage is not None:
        if args.no_evs:
            raise ValueError(f"--evs-stage {args.evs_stage} needs EVS: drop --no-evs")
        options["stage"] = args.evs_stage
    llm = VideoLLM(args.model, compute_dtype=args.compute_dtype)
    if llm.is_random_demo:
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    prompt = args.prompt or DEFAULT_NARRATE_PROMPT
    for segment in llm.narrate(args.video, prompt, realtime=args.realtime, **options):
        skipped = f" ({segment.skipped} skipped)" if segment.skipped else ""
        rollover = "[rollover] " if segment.rolled_over else ""
        t_first, t_last = segment.t
        print(f"{rollover}[{t_first:6.1f}-{t_last:6.1f}s]{skipped} {segment.text.strip()}")
        sys.stdout.flush()
    return 0
