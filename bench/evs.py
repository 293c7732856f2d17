"""EVS rate mode: our `prune` against the published algorithm on the same clip.

The published path is vLLM's compute_retention_mask as written (cosine_similarity, cat with a
255 sentinel, stable argsort, mask), which allocates several clip-sized temporaries. Runs are
interleaved and the median is reported. The masks must agree exactly except where published
dissimilarities lie within 1e-6 of the cut. Threshold mode is timed on the same clip.

    python bench/evs.py                      # t=64, 16x16, dim 3584, fp32 on CPU
    python bench/evs.py --device cuda        # Triton path
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.reference import published_rate_mask

TIE_TOLERANCE = 1e-6


def synthetic_clip(grid: tuple[int, int, int], dim: int, device: str) -> torch.Tensor:
    """Locations that change at different speeds, so dissimilarities spread over [0, 1]."""
    t, h, w = grid
    generator = torch.Generator(device=device).manual_seed(0)
    clip = torch.randn(t, h * w, dim, generator=generator, device=device)  # [t, h*w, dim]
    speed = torch.rand(t, h * w, 1, generator=generator, device=device).pow_(3).mul_(2.0)
    clip.mul_(speed).add_(torch.randn(h * w, dim, generator=generator, device=device))
    return clip.view(t * h * w, dim)


def agreement(ours: torch.Tensor, published: torch.Tensor, ranking: torch.Tensor) -> str:
    """Describe how the masks agree; differences are allowed only at near-ties with the cut."""
    differ = ours != published
    if not bool(differ.any()):
        return "identical"
    count = int(published.sum())
    values = torch.sort(ranking, descending=True, stable=True).values
    cut = values[count - 1 : count + 1]  # last kept, first dropped
    near_cut = (ranking[:, None] - cut[None, :]).abs().min(dim=1).values <= TIE_TOLERANCE
    verdict = "agree by the 1e-6 rule" if bool(near_cut[differ].all()) else "DISAGREE"
    return f"{verdict} ({int(differ.sum())} positions differ)"


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--t", type=int, default=64)
    parser.add_argument("--hw", type=int, default=16, help="h = w of the post-merge grid")
    parser.add_argument("--dim", type=int, default=3584)
    parser.add_argument("--rate", type=float, default=0.5)
    parser.add_argument("--threshold", type=float, default=0.3)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    grid = (args.t, args.hw, args.hw)
    embeds = synthetic_clip(grid, args.dim, args.device)
    rate_config = EVSConfig(mode="rate", rate=args.rate)
    threshold_config = EVSConfig(mode="threshold", threshold=args.threshold)
    paths = {
        "published (vLLM)": lambda: published_rate_mask(embeds, grid, args.rate),
        "ours rate": lambda: prune(embeds, grid, rate_config),
        "ours threshold": lambda: prune(embeds, grid, threshold_config),
    }
    times = {name: [] for name in paths}
    outputs = {name: fn() for name, fn in paths.items()}  # warm-up
    for _ in range(args.runs):
        for name, fn in paths.items():
            elapsed, outputs[name] = timed(fn, args.device)
            times[name].append(elapsed)

    size_mb = embeds.numel() * embeds.element_size() / 1e6
    print(f"grid {grid}, dim {args.dim}, {embeds.dtype} on {args.device}, {size_mb:.0f} MB")
    print(f"threads {torch.get_num_threads()}, median of {args.runs} interleaved runs")
    baseline = statistics.median(times["published (vLLM)"])
    print(f"{'path':<20}{'median ms':>12}{'speedup':>10}  kept")
    published_mask, ranking = outputs["published (vLLM)"]
    kept = {
        "published (vLLM)": int(published_mask.sum()),
        "ours rate": outputs["ours rate"].num_kept_tokens,
        "ours threshold": outputs["ours threshold"].num_kept_tokens,
    }
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<20}{median:>12.1f}{baseline / median:>9.2f}x  {kept[name]}")
    print(f"rate masks: {agreement(outputs['ours rate'].mask, published_mask, ranking)}; ", end="")
    print(f"kept counts equal: {kept['ours rate'] == kept['published (vLLM)']}")


if __name__ == "__main__":
    main()
