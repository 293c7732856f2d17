"""Progress bars for the command line: one while the video is decoded and encoded, one per
generated token, and a long-video summary's (chunks captioned, aggregation rounds).

Decoding and encoding run as one pipeline call with no progress hooks, so that stage shows a
bar that ticks its elapsed time from a helper thread until the call returns. Bars go to stderr
and switch themselves off when stderr is not a terminal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
_TICK_S = 0.1


def run_with_bar(description: str, fn: Callable[[], T], *, enabled: bool) -> T:
    """Call `fn()` while a bar with its elapsed time is shown."""
    if not enabled:
        return fn()
    done = threading.Event()
    with tqdm(desc=description, total=None, unit="", leave=False, disable=None) as bar:

        def tick() -> None:
            while not done.wait(_TICK_S):
                bar.refresh()

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            return fn()
        finally:
            done.set()
            ticker.join()


class TokenBar:
    """A bar over `total` tokens, advanced as the engine produces them; a no-op when off."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        disable = None if enabled else True  # None: off when stderr is not a terminal
        self._bar = tqdm(desc="generate", total=total, unit="tok", leave=False, disable=disable)

    def advance(self, num_tokens: int) -> None:
        if num_tokens:
            self._bar.update(num_tokens)

    def close(self) -> None:
        self._bar.close()


class SummaryBars:
    """A long-video summary's bars: chunks captioned, then each aggregation round's prompts.
    Called with the summary's events (`vision.summary.summarize`); a no-op when off."""

    def __init__(self, *, enabled: bool) -> None:
        self._disable = None if enabled else True  # None: off when stderr is not a terminal
        self._bar: tqdm | None = None
        self._round = 0

    def __call__(self, event: dict) -> None:
        kind = event["type"]
        if kind == "plan":
            self._open("caption chunks", event["num_chunks"], "chunk")
        elif kind == "aggregate" and event["round"] != self._round:
            self._round = event["round"]
            self._open(f"aggregate, round {self._round}", event["num_prompts"], "prompt")
        if kind in ("chunk", "aggregate") and self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _open(self, description: str, total: int, unit: str) -> None:
        self.close()
        self._bar = tqdm(
            desc=description, total=total, unit=unit, leave=False, disable=self._disable
        )
