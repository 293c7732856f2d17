"""Time to first token of a video question, split into decode / tower / EVS / prefill, with the
prefill and the tower in float32 against bfloat16 arithmetic.

A bfloat16 checkpoint of a factory preset (default `3b`: Qwen2.5-VL-3B's shapes, random
weights) is loaded once per compute dtype, with the encoder cache and prefix caching off so
every round encodes and prefills afresh. Each round asks about the clip once per mode, in
turn, with EVS off and at rate 0.75; the table gives medians per stage. "prefill" is
`generate` of one token from the built prompt. Target: bf16's TTFT <= 0.5x fp32's. Where the
CPU has no bfloat16 dot products, bf16 prints "skipped".

    python bench/ttft.py [--preset 3b] [--video CLIP] [--seconds 30] [--fps 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.request import SamplingParams
from stillcut.kernels.cpu_flags import BF16_FLAGS, cpu_flags
from stillcut.kernels.evs.config import EVSConfig
from stillcut.service.api import VideoLLM
from stillcut.vision.pipeline import VideoInput

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "near_static_long.mp4"
EVS = {"EVS off": None, "EVS 0.75": EVSConfig(mode="rate", rate=0.75)}
STAGES = ("decode", "tower", "EVS", "prefill", "TTFT")
ONE_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def load(path: Path, compute_dtype: str) -> VideoLLM:
    config = EngineConfig(
        dtype="bfloat16",
        compute_dtype=compute_dtype,
        scheduler=SchedulerConfig(max_num_batched_tokens=16384, max_model_len=16384),
        cache=CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
    )
    return VideoLLM(path, engine_config=config, encoder_cache_bytes=0)


def ask(llm: VideoLLM, spec: VideoInput) -> dict[str, float]:
    """One question's stages, in seconds."""
    start = time.perf_counter()
    (item,) = llm.encode([spec])
    prompt = llm.processor.build_text("What happens in the video?", [item])
    prefill_start = time.perf_counter()
    llm.engine.generate([prompt], ONE_TOKEN)
    end = time.perf_counter()
    stats = item.stats
    return {
        "decode": stats.get("decode_s", 0.0) + stats.get("preprocess_s", 0.0),
        "tower": stats.get("encode_s", 0.0),
        "EVS": stats.get("evs_s", 0.0),
        "prefill": end - prefill_start,
        "TTFT": end - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="3b")
    parser.add_argument("--video", type=Path, default=SAMPLE)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    computes = ["float32", "bfloat16"]
    if not cpu_flags().intersection(BF16_FLAGS):
        print(f"bf16: skipped (no {' or '.join(BF16_FLAGS)} in this CPU's flags)")
        computes.remove("bfloat16")
    path = cached_checkpoint(args.preset, dtype="bfloat16")
    llms = {compute: load(path, compute) for compute in computes}
    seconds: dict[tuple[str, str], list[dict[str, float]]] = {
        (compute, evs): [] for compute in computes for evs in EVS
    }
    for round_index in range(args.rounds + 1):  # the first round warms up
        for (compute, evs), runs in seconds.items():
            spec = VideoInput(args.video, evs=EVS[evs], fps=args.fps, end=args.seconds)
            stages = ask(llms[compute], spec)
            if round_index:
                runs.append(stages)
    print(f"{args.preset}, {args.video.name} first {args.seconds:g} s at {args.fps:g} fps")
    print(f"{'compute':10} {'EVS':9}" + "".join(f"{stage:>10}" for stage in STAGES))
    medians = {}
    for (compute, evs), runs in seconds.items():
        medians[compute, evs] = {s: statistics.median(r[s] for r in runs) for s in STAGES}
        row = "".join(f"{medians[compute, evs][s]:10.3f}" for s in STAGES)
        print(f"{compute:10} {evs:9}{row}")
    if "bfloat16" in computes:
        for evs in EVS:
            ratio = medians["bfloat16", evs]["TTFT"] / medians["float32", evs]["TTFT"]
            print(f"{evs}: bf16 TTFT / fp32 TTFT = {ratio:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
