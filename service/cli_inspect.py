"""`stillcut inspect VIDEO`: only the vision half of the pipeline — decode, preprocess, encode,
EVS — printing the token plan, what was decoded, the token grid and what EVS kept (`--plan`: the
plan alone, from the container's index)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from stillcut.service.cli_options import (
    RANDOM_WEIGHTS_NOTICE,
    add_compute_dtype_argument,
    add_video_arguments,
    check_arguments,
    evs_config,
    video_options,
)


def add_parser(commands) -> None:
    inspect = commands.add_parser("inspect", help="decode, encode and prune a video; print it")
    inspect.set_defaults(run=_inspect)
    add_video_arguments(inspect)
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--plan", action="store_true", help="only the token plan: decode nothing")
    add_compute_dtype_argument(inspect)


def _inspect(args: argparse.Namespace) -> int:
    from stillcut.demo import demo_checkpoint
    from stillcut.engine.quantization import WeightFormat
    from stillcut.service.evs_default import resolve_evs_default
    from stillcut.vision.decode import DecodeConfig, probe_video
    from stillcut.vision.pipeline import VideoInput, VisionPipeline
    from stillcut.vision.video_plan import PlanLimits, plan_video

    check_arguments(args)
    if not args.video.is_file():
        raise FileNotFoundError(f"{args.video} is not a file")
    choice = evs_config(args)
    model = args.model or demo_checkpoint()
    started = time.perf_counter()
    pipeline = VisionPipeline(
        model,
        weight_format=WeightFormat.for_engine("auto", None, (), "cpu", args.compute_dtype),
        decode_config=DecodeConfig(fps=args.fps, max_frames=args.max_frames, resize=args.resize),
    )
    load_s = time.perf_counter() - started
    evs = resolve_evs_default(pipeline.model_config, choice)
    spec = VideoInput(args.video, evs=evs.evs, **video_options(args))
    started = time.perf_counter()
    limits = PlanLimits(max_video_tokens=args.max_video_tokens)
    plan = {**plan_video(pipeline, spec, limits).to_dict(), "plan_s": time.perf_counter() - started}
    if args.plan:
        print(json.dumps(plan, indent=2) if args.json else _plan_text(plan))
        return 0
    (item,) = pipeline.encode([spec])
    report = {**_report(args, pipeline, item, evs, load_s), "plan": plan}
    if args.start is not None or args.end is not None:  # the item knows only its range's length
        whole = probe_video(args.video, pipeline.decode_config)
        start = args.start or 0.0
        report["range"] = {"start_s": start, "end_s": start + report["source"]["duration_s"]}
        report["source"]["duration_s"] = whole.duration
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    if pipeline.model_config.raw.get("stillcut_random_weights"):
        print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    return 0


def _report(args, pipeline, item, evs, load_s: float) -> dict:
    stats = item.stats
    t, h, w = item.grid_thw
    return {
        "video": str(args.video),
        "model": str(pipeline.path),
        "arithmetic": pipeline.weight_format.arithmetic.to_dict(),
        "source": {
            "codec": stats.get("codec"),
            "width": stats.get("width"),
            "height": stats.get("height"),
            "fps": stats.get("source_fps"),
            "duration_s": stats.get("duration"),
        },
        "sampled": {
            "frames": stats["num_frames"],
            "fps": stats.get("sample_fps"),
            "timestamps": list(item.timestamps),
        },
        "resized": {"width": stats["resized_width"], "height": stats["resized_height"]},
        "patch_grid_thw": [t, h, w],
        "token_grid_thw": list(item.llm_grid),
        "second_per_grid_ts": item.second_per_grid_ts,
        "evs": {
            "setting": evs.setting,
            "source": evs.source,
            "tokens_total": stats["tokens_total"],
            "tokens_kept": stats["tokens_kept"],
            "kept_per_tubelet": list(item.kept_per_tubelet),
        },
        "timings_s": {
            "load_model": load_s,
            **{k: stats[k] for k in ("decode_s", "preprocess_s", "encode_s", "evs_s")},
        },
    }


def _plan_text(plan: dict) -> str:
    t, h, w = plan["token_grid"]
    exact = "" if plan["evs_exact"] else f" (at least {plan['tokens_after_evs_min']})"
    fit = "fits" if plan["fits"] else f"does not fit: {plan['fitting_num_frames']} frames would"
    return "\n".join(
        f"{label:<12}{value}"
        for label, value in (
            ("range", f"{plan['start_s']:.2f}-{plan['end_s']:.2f} s of {plan['codec']}"),
            ("sampled", f"{plan['num_frames']} frames at {plan['sample_fps']:.3g} fps"),
            ("decoding", plan["sampling"]),
            ("tokens", f"{plan['tokens_before_evs']} = {t} tubelets x {h}x{w} before EVS"),
            ("EVS", f"{plan['evs']}: at most {plan['tokens_after_evs']}{exact}"),
            ("KV", f"{plan['kv_bytes'] / 2**20:.1f} MiB (fp32); {fit}"),
            ("planned in", f"{plan['plan_s']:.3f} s"),
        )
    )


def _print_report(report: dict) -> None:
    source, sampled, evs = report["source"], report["sampled"], report["evs"]
    t, h, w = report["patch_grid_thw"]
    lt, lh, lw = report["token_grid_thw"]
    stamps = " ".join(f"{s:.2f}" for s in sampled["timestamps"][:8])
    more = " ..." if len(sampled["timestamps"]) > 8 else ""
    fps = f"{source['fps']:.2f} fps, " if source["fps"] else ""
    kept_share = evs["tokens_kept"] / evs["tokens_total"]
    lines = [
        ("video", report["video"]),
        ("model", report["model"]),
        ("arithmetic", f"{report['arithmetic']['dtype']} ({report['arithmetic']['reason']})"),
        (
            "source",
            f"{source['codec']} {source['width']}x{source['height']}, {fps}"
            f"{source['duration_s']:.2f} s",
        ),
        *(
            [("range", f"{report['range']['start_s']:.2f}-{report['range']['end_s']:.2f} s")]
            if "range" in report
            else []
        ),
        ("sampled", f"{sampled['frames']} frames at {sampled['fps']:.3g} fps: {stamps}{more} s"),
        ("resized", f"{report['resized']['width']}x{report['resized']['height']}"),
        ("patches", f"grid (t, h, w) = ({t}, {h}, {w}): {t * h * w} patches of 2x14x14"),
        ("tokens", f"{lt * lh * lw} video tokens = {lt} tubelets x {lh}x{lw} after 2x2 merge"),
        (
            "EVS",
            f"{evs['setting']} ({evs['source']}): kept {evs['tokens_kept']} of "
            f"{evs['tokens_total']} ({kept_share:.0%})",
        ),
        ("per tubelet", " ".join(str(n) for n in evs["kept_per_tubelet"])),
        (
            "timings",
            ", ".join(f"{k.removesuffix('_s')} {v:.3f} s" for k, v in report["timings_s"].items()),
        ),
    ]
    for label, value in lines:
        print(f"{label:<12}{value}")
