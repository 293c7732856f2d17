"""EVS before the tower: its threshold's calibration and the choice of its metric.

`bench/evs_accuracy.py --stage pixels` calibrates the pixel stage's threshold here (on
training clips, to keep what the embeddings' threshold 0.1 keeps there) before it asks its
questions. Run alone, this compares candidate features of a token before the tower: its merge
group of normalised pixels as they are, less their frame's mean colour (the stage's,
`kernels.evs.pixels`), and the patch embedding's output for it, each with the constant floor
coordinate at several floors. Each is scored by how many of the tokens beyond the first
tubelet that the tower's own EVS keeps at rate 0.75 it keeps at the same rate (the same count
by construction), and on the static clips by the largest share of a clip's later tokens it
puts in one tubelet (the tower's own EVS spreads them), and what it costs per token:

    python bench/evs_pixels.py [--clips 100] [--model PATH]
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import math
import statistics
import time

import torch

from stillcut.demo import demo_checkpoint
from stillcut.demo.clips import clip_bytes, held_out_seeds
from stillcut.demo.scenes import sample_scene
from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.pixels import PIXEL_FLOOR
from stillcut.vision.decode import decode_video
from stillcut.vision.pipeline import VisionPipeline

REFERENCE_TAU = 0.1  # the embeddings' live default, whose kept fraction the calibration matches
FLOORS = (0.0, 0.25, 1.0, 2.0, 4.0, 8.0)  # in RMS units of each candidate's values
RATE = 0.75


def prepared_clip(pipeline: VisionPipeline, data: bytes):
    """A clip's preprocessed input as the pipeline makes it (frames resized in preprocessing)."""
    decoded = decode_video(io.BytesIO(data), pipeline.decode_config)
    return pipeline.media.prepare_video(decoded.frames, decoded.sample_fps)


def token_grid(pipeline: VisionPipeline, prepared) -> tuple[int, int, int]:
    t, h, w = prepared.grid_thw
    merge = pipeline.media.merge_size
    return t, h // merge, w // merge


def calibrate(pipeline: VisionPipeline, clips: list[bytes]) -> tuple[float, float, float]:
    """The pixel threshold keeping, over `clips`, the share of tokens the embeddings' threshold
    `REFERENCE_TAU` keeps: (threshold, that share, the share the threshold reaches)."""
    features, grids, kept, total = [], [], 0, 0
    after = EVSConfig(mode="threshold", threshold=REFERENCE_TAU)
    for data in clips:
        item = pipeline.video(data, evs=after)
        kept, total = kept + item.num_tokens, total + item.num_dense_tokens
        prepared = prepared_clip(pipeline, data)
        features.append(pipeline.media.pixel_features(prepared))
        grids.append(token_grid(pipeline, prepared))
    target = kept / total

    def share(tau: float) -> float:
        before = EVSConfig(mode="threshold", threshold=tau, stage="pixels")
        counts = [prune(f, g, before).num_kept_tokens for f, g in zip(features, grids, strict=True)]
        return sum(counts) / total

    low, high = 0.0, 2.0  # share(low) >= target > share(high), the share falling with tau
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if share(middle) >= target else (low, middle)
    tau = min((low, high), key=lambda t: abs(share(t) - target))
    return tau, target, share(tau)


def group_embeddings(pipeline: VisionPipeline, prepared) -> torch.Tensor:
    """Each token's patch-embedding output, its merge group's rows side by side: [tokens, dim]."""
    with torch.inference_mode():
        embedded = pipeline.tower.patch_embed(prepared.patches).float()  # [patches, hidden]
    return embedded.reshape(-1, pipeline.media.merge_size**2 * embedded.shape[1])


def with_floor(rows: torch.Tensor, floor: float) -> torch.Tensor:
    """`rows` with the constant floor coordinate (`kernels.evs.pixels`), in their own RMS units."""
    constant = torch.full((rows.shape[0], 1), floor * rows.shape[1] ** 0.5)
    return torch.cat((rows.float(), constant), dim=1)


def candidates(pipeline: VisionPipeline, prepared, floor: float) -> dict[str, torch.Tensor]:
    """Every candidate's features of one clip at `floor`."""
    num_tokens = math.prod(token_grid(pipeline, prepared))
    return {
        "pixels": with_floor(prepared.patches.reshape(num_tokens, -1), floor),
        "pixels less frame mean": pipeline.media.pixel_features(prepared, floor),
        "patch embedding": with_floor(group_embeddings(pipeline, prepared), floor),
    }


def best_of(repeats: int, run) -> float:
    """The fewest seconds `run()` took in `repeats` runs (the machine may be shared)."""
    spent = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        spent.append(time.perf_counter() - started)
    return min(spent)


def compare_metrics(pipeline: VisionPipeline, clips: list) -> None:
    """Agreement with the tower's own rate-mode EVS, spread on static clips and cost per token
    of every candidate; `clips` are (scene, clip bytes)."""
    evs = EVSConfig(mode="rate", rate=RATE)
    agree: dict[tuple[str, float], int] = collections.Counter()
    crowded: dict[tuple[str, float], list[float]] = collections.defaultdict(list)
    spent: dict[str, float] = collections.Counter()
    num_later = num_tokens = 0
    for scene, data in clips:
        prepared = prepared_clip(pipeline, data)
        grid = token_grid(pipeline, prepared)
        hw = grid[1] * grid[2]
        static = scene.motion == "none" and scene.event == "none"
        (output,) = pipeline.encode_prepared([prepared])
        masks = {("tower", 0.0): prune(output.embeds, grid, evs).mask[hw:]}  # beyond tubelet 0
        for floor in FLOORS:
            for name, rows in candidates(pipeline, prepared, floor).items():
                masks[name, floor] = prune(rows, grid, evs).mask[hw:]
        reference = masks["tower", 0.0]
        num_later, num_tokens = num_later + int(reference.sum()), num_tokens + grid[0] * hw
        for key, mask in masks.items():
            agree[key] += int((mask & reference).sum())
            if static:
                crowded[key].append(float(mask.view(-1, hw).sum(1).max() / mask.sum()))
        for name in ("pixels less frame mean", "patch embedding"):
            make = functools.partial(_prune_candidate, pipeline, prepared, name, grid, evs)
            spent[name] += best_of(3, make)
    print(f"{len(clips)} held-out clips, rate q={RATE}: of the {num_later} tokens beyond the")
    print("first tubelet that EVS after the tower keeps, the share each candidate keeps too;")
    print(f"on the {len(crowded['tower', 0.0])} static clips, the mean largest share of a clip's")
    print("later kept tokens in one tubelet (EVS after the tower: "
          f"{statistics.mean(crowded['tower', 0.0]):.2f})")  # fmt: skip
    names = ("pixels", "pixels less frame mean", "patch embedding")
    print(f"{'feature':<24}" + "".join(f"{'floor ' + format(f, 'g'):>14}" for f in FLOORS))
    for name in names:
        cells = "".join(
            f"{agree[name, f] / max(1, num_later):>8.1%}{statistics.mean(crowded[name, f]):>6.2f}"
            for f in FLOORS
        )
        print(f"{name:<24}{cells}")
    for name, seconds in spent.items():
        print(f"{name}: {seconds / num_tokens * 1e6:.1f} us a token (features and pruning)")


def _prune_candidate(pipeline, prepared, name: str, grid, evs) -> None:
    prune(candidates(pipeline, prepared, PIXEL_FLOOR)[name], grid, evs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the trained demo)")
    parser.add_argument("--clips", type=int, default=100, help="held-out clips (default 100)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    pipeline = VisionPipeline(args.model or demo_checkpoint())
    clips = [(sample_scene(seed),) for seed in held_out_seeds(args.clips)]
    compare_metrics(pipeline, [(scene, clip_bytes(scene)) for (scene,) in clips])


if __name__ == "__main__":
    main()
