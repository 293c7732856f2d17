"""Progress bars for the command line: one while the video is decoded and encoded, one per
generated token.

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
