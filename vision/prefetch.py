"""Run a generator on a thread of its own, a bounded number of items ahead of its consumer.

Decoding (PyAV) and preprocessing plus the tower (PIL, numpy, torch) all release the GIL, so
on two cores the next window decodes while the current one is encoded. At most `depth` items
wait in the queue: memory stays bounded however long the source. When the consumer stops
early (an error, a refusal), the producer is told to stop, its generator is closed on its own
thread (so the files it holds are closed) and joined before the context exits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
_POLL_S = 0.05
_END = object()


@contextmanager
def prefetched(items: Generator[T, None, None], depth: int = 1) -> Iterator[Iterator[T]]:
    """`items`, produced on a worker thread up to `depth` ahead; its errors re-raise here."""
    assert depth >= 1, depth
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not offer((item, None)):
                    return
            offer((_END, None))
        except BaseException as error:  # handed to the consumer, which re-raises it
            offer((_END, error))
        finally:
            items.close()

    def consume() -> Iterator[T]:
        while True:
            item, error = ready.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item

    worker = threading.Thread(target=produce, name="prefetch", daemon=True)
    worker.start()
    try:
        yield consume()
    finally:
        stop.set()
        worker.join()
