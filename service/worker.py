"""Blocking work off the event loop, one job at a time, behind a bounded queue.

Decoding, preprocessing and the vision tower are CPU-heavy and the pipeline is not
thread-safe, so the server runs them on one worker thread while the event loop keeps
answering; tokenizing prompts, and looking up media the encoder cache already holds, run on
a second one, so a short chat request or a question about a video already seen never waits
behind a long encode. At most `max_pending` jobs wait; one more raises `QueueFull` (503). A
job whose client left still finishes (a running thread cannot be interrupted), and counts as
pending until it does, so the queue depth is the real backlog. Each worker keeps its one
thread for its lifetime, so the server's thread count does not drift with load.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stillcut.service.async_engine import QueueFull

T = TypeVar("T")


class Worker:
    """Runs jobs on one thread named `name`."""

    def __init__(self, name: str, *, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self.name = name
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stillcut-{name}")
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        """Jobs queued or running."""
        return self._pending

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the worker; `QueueFull` when `max_pending` jobs are ahead."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise QueueFull(
                    f"the {self.name} queue is full ({self.max_pending} jobs waiting); retry later"
                )
            self._pending += 1
        future = self._executor.submit(fn)
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        """Drop queued jobs, wait for the running one."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _done(self, _future) -> None:
        with self._lock:
            self._pending -= 1
