"""The command-line options several `stillcut` commands share, and their checks.

Each command's module (`cli_describe`, `cli_inspect`, ...) adds these to its parser and reads
them back into the engine's, the pipeline's and EVS's settings. Heavy imports wait until a
command runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

RANDOM_WEIGHTS_NOTICE = (
    "note: this checkpoint has random weights: decoding, token counts and EVS numbers "
    "are real, generated words would not be"
)


def add_video_arguments(parser: argparse.ArgumentParser, *, frame_caps: bool = True) -> None:
    """The video, the model, sampling and EVS options that `inspect`, `describe` and
    `summarize` share (`frame_caps` False: no `--max-frames` / `--num-frames`, for a summary,
    which samples every chunk at `--fps`)."""
    parser.add_argument("video", type=Path, help="a video file")
    parser.add_argument("--model", help="checkpoint folder or hub id (default: the demo model)")
    parser.add_argument("--fps", type=float, default=2.0, help="sampling rate (default 2)")
    if frame_caps:
        parser.add_argument("--max-frames", type=int, default=64, help="frame cap (default 64)")
    parser.add_argument("--start", type=float, help="start of the range, seconds")
    parser.add_argument("--end", type=float, help="end of the range, seconds")
    if frame_caps:
        parser.add_argument("--num-frames", type=int, help="exactly this many frames, evenly")
    parser.add_argument(
        "--resize",
        choices=("exact", "fast"),
        default="exact",
        help="exact: as the model's processor resizes (default); fast: FFmpeg's scaler at decode",
    )
    parser.add_argument("--min-pixels", type=int, help="pixel budget: fewest pixels per frame")
    parser.add_argument("--max-pixels", type=int, help="pixel budget: most pixels per frame")
    parser.add_argument(
        "--pixel-budget",
        type=_budget_value,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any pixel budget option the model's family takes, e.g. total_pixels=4194304 "
        "(repeatable)",
    )
    parser.add_argument(
        "--max-video-tokens", type=int, help="refuse videos that would keep more tokens"
    )
    add_evs_arguments(parser)


def _budget_value(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be NAME=INTEGER") from None


def video_options(args: argparse.Namespace) -> dict:
    """`VideoInput`'s per-video options from `add_video_arguments`' flags."""
    budget = {"min_pixels": args.min_pixels, "max_pixels": args.max_pixels}
    budget |= dict(args.pixel_budget)
    options = {
        "start": args.start,
        "end": args.end,
        "pixels": tuple((name, value) for name, value in budget.items() if value is not None),
    }
    return options | ({"num_frames": args.num_frames} if "num_frames" in args else {})


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    """How weights and the KV cache are stored: `describe` and `serve` share these."""
    from stillcut.engine.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATION_SKIPS, QUANTIZATIONS

    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="format weights are stored in (default auto: the checkpoint's own); on CPU "
        "activations stay float32 (see --compute-dtype)",
    )
    parser.add_argument(
        "--quantization",
        choices=[name for name in QUANTIZATIONS if name],
        help="store every matrix in int8 with a scale per output channel (CPU); w8a8: "
        "prefill's activations quantized per token too, summed in integers",
    )
    parser.add_argument(
        "--quantization-skip",
        choices=QUANTIZATION_SKIPS,
        action="append",
        default=[],
        help="a part kept unquantized (lm_head: the LM head and a tied embedding)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="K/V pool dtype (default auto: float32 on CPU; bfloat16 holds twice the tokens)",
    )
    add_compute_dtype_argument(parser)


def add_compute_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """`--compute-dtype`: the arithmetic of prefill and the vision tower."""
    from stillcut.engine.config import COMPUTE_DTYPES

    parser.add_argument(
        "--compute-dtype",
        choices=COMPUTE_DTYPES,
        default="auto",
        help="arithmetic of prefill and the vision tower (default auto: bfloat16 for bfloat16 "
        "weights on a CPU with avx512_bf16 or amx_bf16, else float32; decode keeps its own)",
    )


def precision_options(args: argparse.Namespace) -> dict:
    """`EngineConfig`'s precision fields from `add_precision_arguments`' flags."""
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "quantization_skip": tuple(args.quantization_skip),
        "kv_cache_dtype": args.kv_cache_dtype,
        "compute_dtype": args.compute_dtype,
    }


def add_evs_arguments(parser: argparse.ArgumentParser, *, rate: bool = True) -> None:
    """`--evs-rate` (unless `rate` is False), `--evs-threshold`, `--no-evs` and `--evs-stage`:
    the EVS setting when none is asked for. Without `--evs-rate` the stage goes with the
    threshold, given or the stage's default."""
    needs = "with --evs-rate or --evs-threshold" if rate else "with --evs-threshold or alone"
    parser.add_argument(
        "--evs-stage",
        choices=("embeddings", "pixels"),
        help=f"where EVS prunes, {needs}: 'embeddings' after the vision tower (default), "
        "'pixels' before it (the tower encodes only kept tokens)",
    )
    evs = parser.add_mutually_exclusive_group()
    if rate:
        evs.add_argument(
            "--evs-rate",
            type=float,
            default=None,
            help="EVS pruning rate q in [0, 1) (default: the checkpoint's own rate, else 0.75)",
        )
    evs.add_argument("--evs-threshold", type=float, help="causal EVS threshold tau in [0, 2]")
    evs.add_argument("--no-evs", action="store_true", help="keep every token")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding flags that `serve` and `describe` share (off unless a method)."""
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-method", choices=("ngram", "suffix", "draft"), help="off by default"
    )
    spec.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="drafts per step, K (default 4)"
    )
    spec.add_argument("--speculative-model", help="the draft checkpoint (method 'draft')")
    spec.add_argument(
        "--speculative-k-per-batch",
        default="",
        help="cap K by batch size, e.g. '1:4,8:2,32:0' (default: K at every size)",
    )
    spec.add_argument(
        "--no-speculative-dynamic",
        action="store_true",
        help="pin K to the table instead of lowering it where speculation would not pay",
    )


def speculative_config(args: argparse.Namespace):
    """The `SpeculativeConfig` the flags ask for, or None."""
    from stillcut.engine.config import SpeculativeConfig, parse_k_per_batch

    if args.speculative_method is None:
        return None
    return SpeculativeConfig(
        method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.speculative_model,
        k_per_batch=parse_k_per_batch(args.speculative_k_per_batch),
        dynamic=not args.no_speculative_dynamic,
    )


def note_outside_demo_task(args: argparse.Namespace) -> None:
    """With the demo model (no `--model`), say on stderr when the video is one of the EVS and
    speed samples, which lie outside the demo's task."""
    if args.model is None:
        from stillcut.demo.sample_clips import outside_task_notice

        notice = outside_task_notice(args.video)
        if notice is not None:
            print(notice, file=sys.stderr)


def check_video_command(args: argparse.Namespace) -> None:
    """A video command's checks before anything loads: its flags (`check_arguments`), that the
    video is a file, and the demo model's notice for a sample outside its task."""
    check_arguments(args)
    if not args.video.is_file():
        raise FileNotFoundError(f"{args.video} is not a file")
    note_outside_demo_task(args)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad values of the video, EVS and sampling flags a command has, naming the flag,
    before anything loads (a model takes seconds)."""
    from stillcut.engine.request import MAX_COUNT

    checks = (
        ("fps", lambda v: 0 < v < math.inf, "a finite number > 0"),
        ("max_frames", lambda v: v >= 1, "an integer >= 1"),
        ("start", lambda v: 0 <= v < math.inf, "a finite number of seconds >= 0"),
        ("end", lambda v: 0 < v < math.inf, "a finite number of seconds > 0"),
        ("evs_rate", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("evs_threshold", lambda v: 0 <= v <= 2, "in [0, 2]"),
        ("max_tokens", lambda v: 1 <= v <= MAX_COUNT, f"in [1, {MAX_COUNT}]"),
        ("max_tokens_per_segment", lambda v: 1 <= v <= MAX_COUNT, f"in [1, {MAX_COUNT}]"),
        ("temperature", lambda v: 0 <= v <= 100, "in [0, 100]"),
        ("seed", lambda v: 0 <= v < 2**64, "in [0, 2**64 - 1]"),
    )
    for name, fits, allowed in checks:
        value = getattr(args, name, None)
        if value is not None and not fits(value):
            raise ValueError(f"--{name.replace('_', '-')} {value:g} must be {allowed}")
    start, end = getattr(args, "start", None), getattr(args, "end", None)
    if start is not None and end is not None and end <= start:
        raise ValueError(f"--end {end:g} must be after --start {start:g}")


def evs_config(args: argparse.Namespace):
    """The EVS setting the command line asks for: an `EVSConfig`, None (EVS off), or
    `evs_default.UNSET` when no flag was given."""
    from stillcut.kernels.evs import EVSConfig
    from stillcut.service.evs_default import UNSET

    stage = {"stage": args.evs_stage} if getattr(args, "evs_stage", None) else {}
    if args.evs_threshold is not None:
        return EVSConfig(mode="threshold", threshold=args.evs_threshold, **stage)
    if args.evs_rate is not None:
        return EVSConfig(mode="rate", rate=args.evs_rate, **stage)
    if stage:
        raise ValueError(f"--evs-stage {args.evs_stage} needs --evs-rate or --evs-threshold")
    return None if args.no_evs else UNSET
