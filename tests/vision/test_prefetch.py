"""`prefetched` runs a generator ahead on its own thread: items arrive in order, its error is
raised in the consumer, and a consumer that stops early has the generator closed and the
thread joined before the context exits."""

import threading

import pytest

from stillcut.vision.prefetch import prefetched


def _counting(limit: int, closed: list, fail_at: int | None = None):
    try:
        for index in range(limit):
            if index == fail_at:
                raise ValueError(f"bad item {index}")
            yield index
    finally:
        closed.append(threading.current_thread().name)


def test_items_arrive_in_order():
    closed = []
    with prefetched(_counting(50, closed), depth=2) as items:
        assert list(items) == list(range(50))
    assert closed == ["prefetch"]


def test_the_producers_error_is_raised_in_the_consumer():
    closed = []
    with pytest.raises(ValueError, match="bad item 3"):
        with prefetched(_counting(10, closed, fail_at=3)) as items:
            assert [next(items) for _ in range(3)] == [0, 1, 2]
            next(items)
    assert closed == ["prefetch"]


def test_a_consumer_that_stops_early_closes_the_producer():
    closed = []
    before = threading.active_count()
    with pytest.raises(KeyError):
        with prefetched(_counting(10**9, closed)) as items:
            next(items)
            raise KeyError("the consumer gives up")
    assert closed == ["prefetch"] and threading.active_count() == before
