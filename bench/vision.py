"""Vision tower speed and peak memory: stillcut's Qwen2.5-VL tower vs transformers'.

One random Qwen2.5-VL-shaped checkpoint (scaled down to run in seconds on 2 cores: 8 blocks,
width 320, 4 heads of 80 like the real tower, 112 px windows, full attention every 4th block)
is saved once to a temporary folder. Both towers encode the same clip, by default 32 frames
at 448x448 (grid 16 x 32 x 32 = 16384 patches), under `torch.inference_mode()`; the timed runs
alternate between the two so machine noise hits both alike, and the table shows medians.
Peak RSS is measured in a fresh child process per side that loads the checkpoint and encodes
once (its VmHWM, or ru_maxrss without /proc), so neither side's allocations colour the
other's.

    python bench/vision.py [--frames 32] [--size 448] [--runs 5]

`--compute` compares arithmetic instead, on the checkpoint saved in bfloat16: stillcut's tower
computing in float32 (the bf16 weights widened) and in bfloat16 (`compute_dtype`), and
transformers' bf16 tower, interleaved, medians; then EVS (rate 0.75 and threshold 0.1) after a
bf16 and an fp32 tower (the tiny bf16 checkpoint and the trained demo's, every clip in samples/,
EVS itself in fp32 on each tower's output) and how many kept-token decisions agree (target
>= 99 %), over all decisions and over those the rounding noise cannot decide (`--agreement`
runs only this). `--released` gives the tower
the released Qwen2.5-VL shape (32 blocks of width 1280; targets: bf16 >= 2x its fp32 and >= 1.0x
transformers' bf16). Where the CPU has no bfloat16 dot products it prints "skipped".

    python bench/vision.py --compute [--released] [--frames 8] [--size 448] [--runs 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.config import MAX_DISSIMILARITY

PATCH = 14
VISION = {
    "depth": 8,
    "hidden_size": 320,
    "num_heads": 4,
    "intermediate_size": 864,
    "out_hidden_size": 512,
    "window_size": 112,
    "fullatt_block_indexes": [3, 7],
    "initializer_range": 0.1,
}
RELEASED = {  # Qwen2.5-VL's released tower (3B/7B: the same tower, out width aside)
    "depth": 32,
    "hidden_size": 1280,
    "num_heads": 16,
    "intermediate_size": 3420,
    "out_hidden_size": 2048,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "initializer_range": 0.02,
}
TEXT = {  # the smallest language model the config allows; only the tower is measured
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4},
}


def save_checkpoint(folder: Path, vision: dict = VISION, dtype=torch.float32) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=TEXT)
    Qwen2_5_VLForConditionalGeneration(config).to(dtype).save_pretrained(folder)


def clip_inputs(frames: int, size: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Random patches of a `frames` x `size` x `size` clip and its (t, h, w) grid."""
    grid = (frames // 2, size // PATCH, size // PATCH)
    generator = torch.Generator().manual_seed(0)
    patches = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * PATCH * PATCH, generator=generator)
    return patches, grid


def load_encoder(side: str, folder: Path, compute: str = "float32"):
    """A function patches, grid -> merged embeddings [tokens, out_hidden] for one side
    (stillcut's computing in `compute`; transformers' in the checkpoint's dtype)."""
    if side == "stillcut":
        from stillcut.engine.quantization import WeightFormat
        from stillcut.vision.towers import load_vision_tower

        tower = load_vision_tower(folder, WeightFormat(compute=compute))
        return lambda patches, grid: tower.encode([patches], [grid])[0]
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype="auto").eval()
    return lambda patches, grid: model.model.get_video_features(
        patches, torch.tensor([grid])
    ).pooler_output[0]


def peak_rss_child(side: str, folder: Path, frames: int, size: int) -> None:
    """Child process: load one side, encode once, print the peak RSS in MiB."""
    encode = load_encoder(side, folder)
    patches, grid = clip_inputs(frames, size)
    with torch.inference_mode():
        encode(patches, grid)
    print(peak_rss_mib())


def peak_rss_mib() -> float:
    """This process's peak resident set size. Linux carries ru_maxrss over from the parent
    across fork + exec (so a child would report at least the parent's peak); VmHWM belongs to
    this process image alone, so it is preferred where /proc exists."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def time_both(folder: Path, frames: int, size: int, runs: int) -> dict[str, list[float]]:
    encoders = {side: load_encoder(side, folder) for side in ("stillcut", "transformers")}
    patches, grid = clip_inputs(frames, size)
    seconds: dict[str, list[float]] = {side: [] for side in encoders}
    with torch.inference_mode():
        outputs = {side: encode(patches, grid) for side, encode in encoders.items()}  # warm-up
        difference = (outputs["stillcut"] - outputs["transformers"]).abs().max().item()
        scale = outputs["transformers"].abs().max().item()
        for _ in range(runs):
            for side, encode in encoders.items():
                start = time.perf_counter()
                encode(patches, grid)
                seconds[side].append(time.perf_counter() - start)
    print(f"max |stillcut - transformers| = {difference:.2e} (max |transformers| = {scale:.1f})")
    return seconds


def measure_rss(side: str, folder: Path, args: argparse.Namespace) -> float:
    command = [sys.executable, __file__, "--child", side, "--folder", str(folder)]
    command += ["--frames", str(args.frames), "--size", str(args.size)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(result.stdout.split()[-1])


def compare_arithmetic(args: argparse.Namespace) -> None:
    """`--compute`: see the module docstring."""
    from stillcut.kernels.cpu_flags import BF16_FLAGS, cpu_flags

    if not cpu_flags().intersection(BF16_FLAGS):
        print(f"skipped (no {' or '.join(BF16_FLAGS)} in this CPU's flags)")
        return
    vision = RELEASED if args.released else VISION
    patches, grid = clip_inputs(args.frames, args.size)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp), vision, torch.bfloat16)
        sides = {
            "stillcut fp32": load_encoder("stillcut", Path(tmp), "float32"),
            "stillcut bf16": load_encoder("stillcut", Path(tmp), "bfloat16"),
            "transformers bf16": load_encoder("transformers", Path(tmp)),
        }
    print(
        f"Qwen2.5-VL-shaped tower {vision['depth']} blocks, width {vision['hidden_size']}; "
        f"{args.frames} frames at {args.size}x{args.size} -> {grid}; "
        f"{torch.get_num_threads()} threads, {args.runs} interleaved runs"
    )
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    with torch.inference_mode():
        for encode in sides.values():
            encode(patches, grid)  # warm-up
        for _ in range(args.runs):
            for side, encode in sides.items():
                start = time.perf_counter()
                encode(patches, grid)
                seconds[side].append(time.perf_counter() - start)
    medians = {side: statistics.median(times) for side, times in seconds.items()}
    for side, median in medians.items():
        print(f"{side:18} median {median:8.3f} s")
    bf16 = medians["stillcut bf16"]
    print(f"stillcut bf16 vs its fp32: {medians['stillcut fp32'] / bf16:.2f}x (target >= 2)")
    print(f"stillcut bf16 vs transformers bf16: {medians['transformers bf16'] / bf16:.2f}x")
    evs_agreement()


def evs_agreement() -> None:
    """EVS's kept tokens after a bf16 and an fp32 tower over the samples, and their agreement.

    Both the tiny random bf16 checkpoint and the trained demo's tower (stored in bf16) encode
    every sample; EVS runs in fp32 on each output, rate 0.75 and threshold 0.1. A decision is
    a tie when the fp32 dissimilarity lies within the clip's rounding noise (the largest
    |bf16 - fp32| dissimilarity difference) of the cut that decides it: rate mode's cut is the
    last kept token's dissimilarity, threshold mode's the threshold. Which of two tied tokens
    is kept is arbitrary in either arithmetic; the agreement over the other decisions is what
    rounding must not change.
    """
    from stillcut.demo import demo_checkpoint
    from stillcut.engine.factory import cached_checkpoint

    checkpoints = {
        "tiny random": cached_checkpoint("tiny", seed=1, dtype="bfloat16"),
        "trained demo": demo_checkpoint(),
    }
    for name, path in checkpoints.items():
        for config in (
            EVSConfig(mode="rate", rate=0.75),
            EVSConfig(mode="threshold", threshold=0.1),
        ):
            counts = agreement_on_samples(path, config)
            value = config.rate if config.mode == "rate" else config.threshold
            label = f"{name}, {config.mode} {value}"
            for clip, (agree, total, tie_agree, ties) in counts.items():
                print(
                    f"  {label:30} {clip:24} {agree}/{total} agree, {ties} ties ({tie_agree} agree)"
                )
            agree, total, tie_agree, ties = (sum(c[i] for c in counts.values()) for i in range(4))
            beyond = (agree - tie_agree) / max(total - ties, 1)
            print(
                f"{label:30} all decisions {agree / total:.2%} agree; "
                f"beyond rounding ties {beyond:.2%} agree (target >= 99 %); "
                f"{ties / total:.2%} are ties"
            )


def agreement_on_samples(path: Path, config: EVSConfig) -> dict[str, tuple[int, int, int, int]]:
    """Per sample clip: (agreeing decisions, decisions, agreeing ties, ties) bf16 vs fp32."""
    from stillcut.engine.quantization import WeightFormat
    from stillcut.vision.pipeline import VisionPipeline

    pipelines = [
        VisionPipeline(path, weight_format=WeightFormat(compute=dtype))
        for dtype in ("float32", "bfloat16")
    ]
    counts = {}
    for clip in sorted(Path(__file__).parent.parent.joinpath("samples").glob("*.mp4")):
        results = []
        for pipeline in pipelines:
            item = pipeline.video(clip, evs=None)
            results.append(prune(item.embeds.float(), item.llm_grid, config))
        fp32, bf16 = results
        later = fp32.dissimilarity < MAX_DISSIMILARITY  # the first tubelet is always kept
        noise = (bf16.dissimilarity - fp32.dissimilarity)[later].abs().max()
        kept_later = fp32.dissimilarity[fp32.mask & later]
        if config.mode == "rate" and kept_later.numel():
            cut = kept_later.min()
        elif config.mode == "rate":
            cut = fp32.dissimilarity[later].max()
        else:
            cut = torch.tensor(config.threshold)
        tie = later & ((fp32.dissimilarity - cut).abs() <= noise)
        same = fp32.mask == bf16.mask
        counts[clip.name] = (
            int(same.sum()),
            same.numel(),
            int((same & tie).sum()),
            int(tie.sum()),
        )
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", action="store_true", help="bf16 vs fp32 arithmetic")
    parser.add_argument(
        "--agreement", action="store_true", help="only the EVS agreement of --compute"
    )
    parser.add_argument("--released", action="store_true", help="the released tower's shape")
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--size", type=int, default=448, help="frame side in px, multiple of 28")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child", choices=("stillcut", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peak_rss_child(args.child, args.folder, args.frames, args.size)
        return
    if args.agreement:
        evs_agreement()
        return
    if args.compute:
        compare_arithmetic(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_checkpoint(folder)
        _, grid = clip_inputs(args.frames, args.size)
        print(
            f"Qwen2.5-VL-shaped tower {VISION['depth']} blocks, width {VISION['hidden_size']}, "
            f"{VISION['num_heads']} heads; {args.frames} frames at {args.size}x{args.size} -> "
            f"grid {grid} = {grid[0] * grid[1] * grid[2]} patches; "
            f"{torch.get_num_threads()} threads, {args.runs} interleaved runs"
        )
        seconds = time_both(folder, args.frames, args.size, args.runs)
        rss = {side: measure_rss(side, folder, args) for side in seconds}
    medians = {side: statistics.median(times) for side, times in seconds.items()}
    print(f"{'':14} {'median s':>9} {'min s':>7} {'peak RSS MiB':>13}")
    for side, times in seconds.items():
        print(f"{side:14} {medians[side]:9.3f} {min(times):7.3f} {rss[side]:13.0f}")
    ratio = medians["stillcut"] / medians["transformers"]
    print(f"time ratio stillcut/transformers = {ratio:.3f} (target <= 1.05)")
    print(f"RSS ratio  stillcut/transformers = {rss['stillcut'] / rss['transformers']:.3f}")


if __name__ == "__main__":
    main()
