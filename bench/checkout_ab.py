"""The same bench in two checkouts, run alternately as child processes: medians and ratios.

A speed claim of a change ("within 5 % of before") needs the old and the new code timed on the
same machine at the same time; on a shared host the read bandwidth alone drifts by tens of
percent within minutes. Each round runs the bench once in each checkout (the order alternates
from round to round) with that checkout's own virtual environment, reads the numbers named by
`--metric NAME=REGEX` (the first group of the regex, in the bench's output), and the table gives
each side's median and the median over rounds of new ÷ base (the two runs of a round are
adjacent in time); each round's line also shows the host's 1-minute load average. By default it
runs `bench/decode_roofline.py` and reads its batch-1 native step and that step ÷ its read
floor (measured in the same process).

    python bench/checkout_ab.py --base ../other-checkout [--rounds 6] [-- bench args...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOFLINE_METRICS = (
    r"step ms=^\s+1\s+native step\s+([\d.]+)",
    r"step/floor=^\s+1\s+native step\s+[\d.]+\s+[\d.]+\s+([\d.]+)",
)


def run_once(root: Path, python: Path, bench: list[str]) -> str:
    """The bench's output, run from `root` with `python`."""
    result = subprocess.run(
        [str(python), *bench], cwd=root, capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise SystemExit(f"{root}: {' '.join(bench)} failed:\n{result.stderr[-2000:]}")
    return result.stdout


def read_metrics(output: str, metrics: dict[str, re.Pattern]) -> dict[str, float]:
    values = {}
    for name, pattern in metrics.items():
        found = pattern.search(output)
        if found is None:
            raise SystemExit(f"metric {name!r} ({pattern.pattern}) not in:\n{output}")
        values[name] = float(found.group(1))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--bench", default="bench/decode_roofline.py", help="script to run")
    parser.add_argument("--metric", action="append", help="NAME=REGEX (first group)")
    parser.add_argument("bench_args", nargs="*", help="after --: the bench's own arguments")
    args = parser.parse_args()
    metrics = {
        name: re.compile(pattern, re.MULTILINE)
        for name, pattern in (item.split("=", 1) for item in args.metric or ROOFLINE_METRICS)
    }
    sides = {"base": args.base.resolve(), "new": ROOT}
    bench = [args.bench, *args.bench_args]
    values: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for round_index in range(args.rounds):
        load = os.getloadavg()[0]  # a shared host's other work, beside the round's numbers
        order = ("base", "new") if round_index % 2 == 0 else ("new", "base")
        for side in order:
            root = sides[side]
            output = run_once(root, root / ".venv" / "bin" / "python", bench)
            values[side].append(read_metrics(output, metrics))
        line = "  ".join(
            f"{name} {values['base'][-1][name]:.3f}/{values['new'][-1][name]:.3f}"
            for name in metrics
        )
        print(
            f"round {round_index + 1}/{args.rounds} (load {load:.1f}; base/new): {line}",
            file=sys.stderr,
        )
    print(f"{args.rounds} rounds of {' '.join(bench)}, base {sides['base']}, new {ROOT}")
    print(f"{'metric':<14}{'base':>10}{'new':>10}{'new/base':>10}")
    for name in metrics:
        base = [run[name] for run in values["base"]]
        new = [run[name] for run in values["new"]]
        ratio = statistics.median(n / b for n, b in zip(new, base, strict=True))
        print(
            f"{name:<14}{statistics.median(base):>10.3f}{statistics.median(new):>10.3f}"
            f"{ratio:>10.3f}"
        )


if __name__ == "__main__":
    main()
