"""EVS accuracy: how much pruning the trained demo's answers survive, per question type.

Renders the held-out scenes of the demo task (seeds never used in training; the clips are kept
in `bench/out/` for the next run), encodes each clip once (the encoder cache serves every
setting of EVS after the tower), and asks each question type's canonical prompt with EVS off,
rate q = 0.5 / 0.75 / 0.8 / 0.9 and threshold tau at several values. Each answer is scored by
its keywords (`stillcut.demo.questions.is_correct`); the table shows accuracy per type and the
fraction of video tokens kept; under it, what the wrong descriptions with EVS off got wrong
(an object's colour or shape left out, the subject's or a bystander's; words not in the
scene; the event, the ground, the motion). Then, for the long near-static sample clip, it
counts the tokens kept for growing lengths: a threshold's cost should grow far slower than
the clip, a rate's grows with it.

Narration: held-out scenes of the narration mix (`scenes.NARRATION_MIX`, the held-out seeds)
narrated as `stillcut narrate` does (lag `queue`), with threshold EVS at the narration default
and off; each segment is right when it names its tubelet's true change and no other
(`narration.segment_is_correct`), counted per change (a change's share is of the judged
segments). Captions: pairs of held-out scenes rendered back to back into one clip, one chunk
of 2-4 s from each (half across the cut) captioned with the chunk prompt
(`chunk_prompts.chunk_caption_messages`), EVS off (what a summary gives chunks this short
by default) and at describe's default rate, named (which keeps only a chunk's first tubelet:
`vision.summary.chunks`); a caption is
right when each scene part's clause names what happens there, in order
(`captions.caption_is_correct`).

`--stage pixels` puts EVS before the tower beside EVS after it, on the questions: rate q = 0.75
in both stages (the same kept count by construction), and threshold 0.1 after the tower against
the pixel threshold that keeps as much on training clips (`evs_pixels.calibrate`; the share it
keeps on the held-out clips is in its row), each pair's difference per question type in
points; then the near-static clip's counts in both stages.

    python bench/evs_accuracy.py [--model PATH] [--clips 500] [--narration-clips 200]
        [--caption-chunks 200] [--only questions|narration|captions]
        [--stage pixels [--calibration-clips 200]]
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from evs_pixels import calibrate

from stillcut.demo import demo_checkpoint
from stillcut.demo.captions import ScenePart, caption_is_correct, chunk_parts, draw_chunk
from stillcut.demo.chunk_prompts import chunk_caption_messages
from stillcut.demo.clips import (
    TASK_X264_PARAMS,
    clip_bytes,
    encode_h264,
    held_out_seeds,
    training_seeds,
)
from stillcut.demo.narration import (
    CHANGES,
    FRAMES_PER_TUBELET,
    NARRATION_FPS,
    segment_is_correct,
    tubelet_change,
)
from stillcut.demo.questions import EVENTS, PROMPTS, QUESTION_TYPES, is_correct
from stillcut.demo.render import frames
from stillcut.demo.scenes import COLOURS, NARRATION_MIX, SHAPES, Scene, sample_scene
from stillcut.demo.train import TASK_VERSION
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig, prune
from stillcut.service.api import DEFAULT_KV_CACHE_BYTES, VideoLLM
from stillcut.vision.decode import DecodeConfig

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
# Rendered clips are kept between runs (rendering 500 takes minutes); a new task version
# renders afresh.
CLIP_DIR = Path(__file__).resolve().parent / "out" / f"evs_accuracy_clips_task{TASK_VERSION}"
# 0.8 keeps about what the largest tau keeps, for rate against threshold at equal kept fractions
RATES = (0.5, 0.75, 0.8, 0.9)
TAUS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4)
CHUNK = 100  # clips asked about together: every question reuses its clip's cached prefix
# The demo is tiny: a step can carry many more prompts than the service's defaults allow.
ENGINE_CONFIG = EngineConfig(
    scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_num_seqs=256),
    cache=CacheConfig(kv_cache_memory=DEFAULT_KV_CACHE_BYTES),
)
MAX_TOKENS = 48
LONG_CLIP_ENDS_S = (30.0, 60.0, 120.0, 240.0)
LONG_CLIP_TAU = 0.1
RATE = EVSConfig(mode="rate", rate=0.75)
PIXEL_RATE = EVSConfig(mode="rate", rate=0.75, stage="pixels")
POINTS_BELOW = 2.0  # how far below EVS after the tower the pixel stage may score, per type


def rendered_set(seeds: range) -> list[tuple[Scene, bytes]]:
    """The scenes of `seeds` and their clips, rendered once into `CLIP_DIR`."""
    CLIP_DIR.mkdir(parents=True, exist_ok=True)
    clips = []
    for seed in seeds:
        scene, path = sample_scene(seed), CLIP_DIR / f"{seed}.mp4"
        if not path.is_file():
            path.write_bytes(clip_bytes(scene))
        clips.append((scene, path.read_bytes()))
    return clips


def held_out_set(count: int) -> list[tuple[Scene, bytes]]:
    """The first `count` held-out scenes and their clips."""
    return rendered_set(held_out_seeds(count))


def narration_set(count: int) -> list[tuple[Scene, Path]]:
    """The first `count` held-out scenes of the narration mix and their clips' paths."""
    folder = CLIP_DIR / f"narration-{zlib.crc32(repr(NARRATION_MIX).encode()):08x}"  # per mix
    folder.mkdir(parents=True, exist_ok=True)
    clips = []
    for seed in held_out_seeds(count):
        scene, path = sample_scene(seed, mix=NARRATION_MIX), folder / f"{seed}.mp4"
        if not path.is_file():
            path.write_bytes(clip_bytes(scene))
        clips.append((scene, path))
    return clips


def caption_set(count: int) -> list[tuple[list[ScenePart], Path, float, float]]:
    """`count` chunks, one from each pair of held-out scenes played back to back: the chunk's
    scene parts, the pair's clip and the chunk's start and end (s)."""
    folder = CLIP_DIR / "pairs"
    folder.mkdir(parents=True, exist_ok=True)
    seeds = iter(held_out_seeds(2 * count))
    chunks = []
    for first_seed, second_seed in zip(seeds, seeds, strict=True):
        first, second = sample_scene(first_seed), sample_scene(second_seed)
        path = folder / f"{first_seed}-{second_seed}.mp4"
        if not path.is_file():
            images = itertools.chain(frames(first), frames(second))
            with path.open("wb") as out:
                encode_h264(out, images, first.fps, crf=first.crf, x264_params=TASK_X264_PARAMS)
        start, end = draw_chunk(np.random.default_rng(first_seed), first.duration_s)
        chunks.append((chunk_parts(first, second, start, end), path, start, end))
    return chunks


def narration_row(llm: VideoLLM, clips: list, threshold: str) -> str:
    """Segments judged, accuracy, and per change its accuracy and share, for one setting."""
    options = {"threshold": None} if threshold == "off" else {}
    judged, right = Counter(), Counter()
    for scene, path in clips:
        for segment in llm.narrate(path, lag="queue", **options):
            index = round(segment.t[0] * NARRATION_FPS) // FRAMES_PER_TUBELET
            change = tubelet_change(scene, index)
            judged[change] += 1
            right[change] += segment_is_correct(scene, index, segment.text)
    total = sum(judged.values())
    cells = "".join(
        f"{right[c] / max(1, judged[c]):>10.1%}{judged[c] / max(1, total):>7.0%}" for c in CHANGES
    )
    return f"{threshold:<22}{total:>9}{sum(right.values()) / max(1, total):>10.1%}{cells}"


def caption_row(llm: VideoLLM, chunks: list, evs: EVSConfig | None) -> float:
    """The share of chunks captioned right under one EVS setting."""
    processor, prompts = llm.engine.processor, []
    for _, path, start, end in chunks:
        item = llm.pipeline.video(path, evs=evs, start=start, end=end)
        prompts.append(processor.build(chunk_caption_messages(start, end), [item]))
    outputs = llm.engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    right = sum(
        caption_is_correct(parts, output.text)
        for (parts, _, _, _), output in zip(chunks, outputs, strict=True)
    )
    return right / len(chunks)


def settings() -> list[tuple[str, EVSConfig | None]]:
    rates = [(f"rate q={q:g}", EVSConfig(mode="rate", rate=q)) for q in RATES]
    taus = [(f"threshold tau={t:g}", EVSConfig(mode="threshold", threshold=t)) for t in TAUS]
    return [("off", None), *rates, *taus]


def accuracy_row(
    llm: VideoLLM, clips: list, evs: EVSConfig | None, misses: Counter | None = None
) -> tuple[float, dict]:
    """Kept-token fraction and accuracy per question type under one EVS setting (and, into
    `misses`, what the wrong descriptions got wrong: `describe_misses`)."""
    right = dict.fromkeys(QUESTION_TYPES, 0)
    kept = total = 0
    for start in range(0, len(clips), CHUNK):
        chunk = clips[start : start + CHUNK]
        for kind in QUESTION_TYPES:
            results = llm.describe_many(
                [data for _, data in chunk], PROMPTS[kind][0], evs=evs, max_tokens=MAX_TOKENS
            )
            for (scene, _), result in zip(chunk, results, strict=True):
                correct = is_correct(scene, kind, result.text)
                right[kind] += correct
                if kind == "describe" and not correct and misses is not None:
                    misses.update(describe_misses(scene, result.text))
            kept += sum(r.evs.tokens_after for r in results)
            total += sum(r.evs.tokens_before for r in results)
    return kept / total, {kind: right[kind] / len(clips) for kind in QUESTION_TYPES}


def describe_misses(scene: Scene, text: str) -> set[str]:
    """What a wrong description got wrong, one tag per kind of mistake: an object's colour or
    shape left out ("subject" or "bystander": whose), a colour or shape not in the scene, an
    event or "still"/"nothing" said or left out, the ground or the motion left out."""
    words = set(re.findall(r"[a-z]+", text.lower()))
    tags = set()
    for index, obj in enumerate(scene.objects):
        role = "subject" if index == scene.subject else "bystander"
        tags |= {f"{role} colour left out"} if obj.colour not in words else set()
        tags |= {f"{role} shape left out"} if obj.shape not in words else set()
    if words & (set(COLOURS) - {o.colour for o in scene.objects}):
        tags.add("colour not in the scene")
    if words & (set(SHAPES) - {o.shape for o in scene.objects}):
        tags.add("shape not in the scene")
    said = words & set(EVENTS)
    if said != ({scene.event} - {"none"}):
        tags.add("event wrong")
    if scene.ground not in words:
        tags.add("ground left out")
    if scene.motion != "none" and scene.motion not in words:
        tags.add("motion left out")
    if (scene.subject is None) != ("nothing" in words):
        tags.add("'nothing changes' wrong")
    return tags


def long_clip_rows(llm: VideoLLM, pixel_tau: float | None = None) -> None:
    """Tokens kept for growing prefixes of the near-static clip: encoded once, pruned per
    prefix (threshold mode is causal, so a prefix keeps what the shorter clip would); with
    `pixel_tau`, EVS before the tower beside, each prefix encoded as its own clip."""
    clip = SAMPLES / "near_static_long.mp4"
    print(f"\n{clip.name}: video tokens kept for the first N seconds (2 fps, no frame cap)")
    dense = llm.pipeline.video(clip, evs=None, end=max(LONG_CLIP_ENDS_S))
    t, h, w = dense.llm_grid
    columns = [("dense", None), ("rate q=0.75", RATE)]
    columns.append((f"tau={LONG_CLIP_TAU:g}", EVSConfig(mode="threshold", threshold=LONG_CLIP_TAU)))
    before = []
    if pixel_tau is not None:
        pixel_threshold = EVSConfig(mode="threshold", threshold=pixel_tau, stage="pixels")
        before = [("pixels q=0.75", PIXEL_RATE), (f"pixels tau={pixel_tau:.3g}", pixel_threshold)]
    names = [name for name, _ in (*columns, *before)]
    print(f"{'seconds':>8}" + "".join(f"{name:>18}" for name in names))
    for end in LONG_CLIP_ENDS_S:
        num_tubelets = min(t, round(end * DecodeConfig().fps / 2))  # 2 frames a tubelet
        embeds = dense.embeds[: num_tubelets * h * w]
        counts = [
            len(embeds) if evs is None else prune(embeds, (num_tubelets, h, w), evs).num_kept_tokens
            for _, evs in columns
        ]
        counts += [llm.pipeline.video(clip, evs=evs, end=end).num_tokens for _, evs in before]
        print(f"{end:>8g}" + "".join(f"{count:>18}" for count in counts))


def print_row(name: str, kept: float, accuracy: dict) -> None:
    cells = "".join(f"{accuracy[kind]:>10.1%}" for kind in QUESTION_TYPES)
    print(f"{name:<26}{kept:>6.1%}{cells}", flush=True)


def question_rows(llm: VideoLLM, count: int) -> None:
    clips = held_out_set(count)
    header = f"{'EVS':<26}{'kept':>6}" + "".join(f"{kind:>10}" for kind in QUESTION_TYPES)
    print(f"{len(clips)} held-out clips\n{header}")
    misses = Counter()
    for name, evs in settings():
        print_row(name, *accuracy_row(llm, clips, evs, misses if evs is None else None))
    print("\nwrong descriptions with EVS off, by what they got wrong (one may have several):")
    for tag, count in misses.most_common():
        print(f"  {tag:<28}{count:>5} of {len(clips)} clips")
    long_clip_rows(llm)


def pixel_stage_rows(llm: VideoLLM, count: int, calibration_count: int) -> None:
    """EVS before the tower against EVS after it: rate 0.75 in both stages, threshold 0.1
    after against the calibrated pixel threshold; per pair the difference in points."""
    training = [data for _, data in rendered_set(training_seeds(calibration_count))]
    tau, target, reached = calibrate(llm.pipeline, training)
    print(
        f"pixel threshold calibrated on {len(training)} training clips: tau={tau:.4g} keeps "
        f"{reached:.1%} of their tokens (threshold {LONG_CLIP_TAU:g} after the tower: {target:.1%})"
    )
    clips = held_out_set(count)
    pixel_threshold = EVSConfig(mode="threshold", threshold=tau, stage="pixels")
    pairs = [
        ("rate q=0.75", "rate q=0.75", RATE, PIXEL_RATE),
        (
            f"tau={LONG_CLIP_TAU:g}",
            f"tau={tau:.3g}",
            EVSConfig(mode="threshold", threshold=LONG_CLIP_TAU),
            pixel_threshold,
        ),
    ]
    header = f"{'EVS':<26}{'kept':>6}" + "".join(f"{kind:>10}" for kind in QUESTION_TYPES)
    print(f"{len(clips)} held-out clips\n{header}")
    for name_after, name_before, after, before in pairs:
        rows = [accuracy_row(llm, clips, evs) for evs in (after, before)]
        print_row(f"after:  {name_after}", *rows[0])
        print_row(f"before: {name_before}", *rows[1])
        # in points, rounded so that exactly 2 points below counts as 2
        gaps = {
            kind: round(100 * (rows[1][1][kind] - rows[0][1][kind]), 6) for kind in QUESTION_TYPES
        }
        cells = "".join(f"{gaps[kind]:>+9.1f}p" for kind in QUESTION_TYPES)
        verdict = "met" if min(gaps.values()) >= -POINTS_BELOW else "MISSED"
        print(f"{'  before - after':<32}{cells}  (>= -{POINTS_BELOW:g} points: {verdict})")
    print("(after: EVS after the tower, on its embeddings; before: on pixels, before the tower)")
    long_clip_rows(llm, tau)


def narration_rows(llm: VideoLLM, count: int) -> None:
    clips = narration_set(count)
    print(f"\nnarration of {len(clips)} held-out clips (lag queue): accuracy, then per change")
    print(
        f"{'EVS':<22}{'segments':>9}{'right':>10}"
        + "".join(f"{c:>10}{'share':>7}" for c in CHANGES)
    )
    for threshold in ("threshold default", "off"):
        print(narration_row(llm, clips, threshold), flush=True)


def caption_rows(llm: VideoLLM, count: int) -> None:
    chunks = caption_set(count)
    across = sum(len(parts) == 2 for parts, _, _, _ in chunks)
    print(f"\ncaptions of {len(chunks)} chunks ({across} across a cut)")
    named = f"{llm.evs_default.setting} (named)"
    for name, evs in (("off (summary default)", None), (named, llm.evs_default.evs)):
        print(f"{name:<26}{caption_row(llm, chunks, evs):>10.1%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the trained demo)")
    parser.add_argument("--clips", type=int, default=500, help="held-out clips (default 500)")
    parser.add_argument("--narration-clips", type=int, default=200, help="(default 200)")
    parser.add_argument("--caption-chunks", type=int, default=200, help="(default 200)")
    parser.add_argument("--only", choices=("questions", "narration", "captions"))
    parser.add_argument(
        "--stage",
        choices=("embeddings", "pixels"),
        default="embeddings",
        help="'pixels': EVS before the tower beside EVS after it, on the questions",
    )
    parser.add_argument("--calibration-clips", type=int, default=200, help="(default 200)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    llm = VideoLLM(
        args.model or demo_checkpoint(),
        engine_config=ENGINE_CONFIG,
        decode_config=DecodeConfig(max_frames=10_000),
    )
    if args.stage == "pixels":
        pixel_stage_rows(llm, args.clips, args.calibration_clips)
    elif args.only in (None, "questions"):
        question_rows(llm, args.clips)
    if args.stage == "embeddings" and args.only in (None, "narration"):
        narration_rows(llm, args.narration_clips)
    if args.stage == "embeddings" and args.only in (None, "captions"):
        caption_rows(llm, args.caption_chunks)
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
