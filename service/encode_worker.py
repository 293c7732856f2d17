"""Video decoding and encoding off the event loop, one job at a time, behind a bounded queue.

Decoding, preprocessing and the vision tower are CPU-heavy and the pipeline is not
thread-safe, so the server runs them on a single worker thread while the event loop keeps
answering. At most `max_pending` jobs wait; one more raises `QueueFull` (503). A job whose
client left still finishes (a running thread cannot be interrupted), and counts as pending
until it does, so the queue depth is the real backlog.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stillcut.engine.multimodal import MultiModalItem
from stillcut.service.async_engine import QueueFull
from stillcut.vision.pipeline import ImageInput, VideoInput

T = TypeVar("T")


class EncodeWorker:
    """Runs `encode(inputs)` (a `VideoLLM.encode`) on one worker thread."""

    def __init__(
        self,
        encode: Callable[[Sequence[VideoInput | ImageInput]], list[MultiModalItem]],
        *,
        max_pending: int,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self._encode = encode
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stillcut-encode")
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        """Jobs queued or running."""
        return self._pending

    async def encode(self, inputs: Sequence[VideoInput | ImageInput]) -> list[MultiModalItem]:
        """Encode `inputs` on the worker; `QueueFull` when `max_pending` jobs are ahead."""
        return await self.run(lambda: self._encode(inputs))

    async def run(self, fn: Callable[[], T]) -> T:
        """Run any pipeline work `fn()` on the worker, under the same bound."""
        with self._lock:
            if self._pending >= self.max_pending:
                raise QueueFull(
                    f"the encoder queue is full ({self.max_pending} jobs waiting); retry later"
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
