"""EVS fidelity on the sample clips: how much is kept, and how much true motion survives.

Runs the random-demo preset's vision tower (random weights; `bench/evs_accuracy.py` scores
the trained demo by its answers) over `samples/motion_mask.mp4` with no frame cap, then for
several EVS settings reports the fraction of tokens kept and the recall of tokens whose
patches truly changed (from the clip's ground-truth motion mask).
Then, at every tau whose recall is >= 0.9 (the smallest tried and the largest, cheapest one
included), it counts the tokens threshold mode keeps for the first 60 s and the first 240 s of
the near-static clip: static footage should cost far less than 4x as much for 4x the time.

A token (t, y, x) "truly changed" when any pixel of its 28x28 footprint changed in a source
frame after the previous tubelet's first frame and up to this tubelet's last frame. The first
tubelet is always kept and is left out of recall.

    python bench/evs_fidelity.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from stillcut.engine.factory import random_demo_checkpoint
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.pipeline import VisionPipeline

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
TAUS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
RATES = (0.5, 0.75, 0.9)
TARGET_RECALL = 0.9
CAVEAT = (
    "Random-weight towers mix static and moving regions (every token attends to its whole\n"
    "frame), so these recall figures show the mechanism, not a real model's quality."
)


def changed_tokens(item, mask: np.ndarray, fps: float) -> torch.Tensor:
    """Ground truth [t, h, w] bool: did the token's footprint change since the last tubelet?"""
    t, h, w = item.llm_grid
    frame_index = np.rint(np.asarray(item.timestamps) * fps).astype(int)
    frame_index = np.concatenate([frame_index, frame_index[-1:]])  # the padded last frame
    height, width = mask.shape[1:]
    assert (height, width) == (item.stats["resized_height"], item.stats["resized_width"]), (
        "the motion-mask clip must need no resize"
    )
    truth = torch.zeros(t, h, w, dtype=torch.bool)
    for k in range(1, t):
        first, last = frame_index[2 * k - 2] + 1, frame_index[2 * k + 1]
        moved = mask[first : last + 1].any(axis=0)  # [H, W]
        blocks = moved.reshape(h, height // h, w, width // w).any(axis=(1, 3))
        truth[k] = torch.from_numpy(blocks)
    return truth


def kept_grid(item) -> torch.Tensor:
    t, h, w = item.llm_grid
    grid = torch.zeros(t, h, w, dtype=torch.bool)
    grid[tuple(item.coords.T)] = True
    return grid


def fidelity_row(pipeline, clip: Path, evs: EVSConfig, truth: torch.Tensor) -> tuple:
    item = pipeline.video(clip, evs=evs)
    kept = kept_grid(item)
    later = slice(1, None)
    recall = (kept[later] & truth[later]).sum().item() / max(truth[later].sum().item(), 1)
    return item.num_tokens / item.num_dense_tokens, recall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the random-demo preset)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    decode = DecodeConfig(fps=2.0, max_frames=10_000)
    pipeline = VisionPipeline(args.model or random_demo_checkpoint(), decode_config=decode)

    clip = SAMPLES / "motion_mask.mp4"
    ground = np.load(SAMPLES / "motion_mask.npz")
    dense = pipeline.video(clip)
    truth = changed_tokens(dense, ground["mask"], float(ground["fps"]))
    print(
        f"motion_mask.mp4: {dense.stats['num_frames']} frames, grid {dense.llm_grid}, "
        f"{int(truth[1:].sum())} of {truth[1:].numel()} later tokens truly changed\n"
    )
    print(f"{'setting':<28}{'kept':>8}{'recall':>8}")
    meeting = []
    for tau in TAUS:
        kept, recall = fidelity_row(
            pipeline, clip, EVSConfig(mode="threshold", threshold=tau), truth
        )
        print(f"{'threshold tau=' + format(tau, 'g'):<28}{kept:>8.3f}{recall:>8.3f}")
        if recall >= TARGET_RECALL:
            meeting.append(tau)
    for q in RATES:
        kept, recall = fidelity_row(pipeline, clip, EVSConfig(mode="rate", rate=q), truth)
        print(f"{'rate q=' + format(q, 'g'):<28}{kept:>8.3f}{recall:>8.3f}")
    print()
    if not meeting:
        print(f"no tau in {TAUS} reaches recall {TARGET_RECALL}")
        return
    # Every tau with recall >= 0.9: the smallest one tried, and the largest (cheapest) one.
    long_clip = SAMPLES / "near_static_long.mp4"
    print(f"near_static_long.mp4, threshold mode at each tau with recall >= {TARGET_RECALL}")
    print(f"{'tau':>8}{'kept 0-60 s':>14}{'kept 0-240 s':>14}{'ratio':>8}  target < 2")
    for tau in meeting:
        evs = EVSConfig(mode="threshold", threshold=tau)
        first = pipeline.video(long_clip, evs=evs, end=60.0)
        whole = pipeline.video(long_clip, evs=evs, end=240.0)
        ratio = whole.num_tokens / first.num_tokens
        verdict = "met" if ratio < 2 else "MISSED"
        print(f"{tau:>8g}{first.num_tokens:>14}{whole.num_tokens:>14}{ratio:>8.2f}  {verdict}")
    dense_first = first.num_dense_tokens
    print(f"(dense: {dense_first} tokens for 0-60 s, {whole.num_dense_tokens} for 0-240 s)\n")
    print(CAVEAT)


if __name__ == "__main__":
    main()
