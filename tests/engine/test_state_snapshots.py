"""Snapshot slots of recurrent states: LRU eviction, and eviction with their block."""

from stillcut.engine.kv_cache import BlockPool
from stillcut.engine.state_snapshots import SnapshotPool, StateCapture


def _save(pool: SnapshotPool, block_hash: bytes) -> int:
    slot = pool.reserve(block_hash)
    assert slot is not None
    pool.commit(StateCapture(1, slot, block_hash), block_cached=True)
    return slot


def test_a_full_pool_evicts_the_least_recently_used_snapshot():
    pool = SnapshotPool(2, interval=1)
    _save(pool, b"a")
    _save(pool, b"b")
    pool.restore(b"a")  # now b is the least recently used
    _save(pool, b"c")
    assert pool.slot_of(b"b") is None and pool.slot_of(b"a") is not None
    assert (pool.num_saved, pool.num_restored, pool.num_evicted) == (3, 1, 1)
    pool.check_consistency()


def test_a_snapshot_leaves_with_its_block_and_an_uncached_capture_frees_its_slot():
    pool = SnapshotPool(2, interval=1)
    blocks = BlockPool(1, on_evict=pool.drop)
    (block,) = blocks.allocate(1)
    blocks.cache(block, b"a")
    _save(pool, b"a")
    slot = pool.reserve(b"x")
    pool.commit(StateCapture(1, slot, b"x"), block_cached=False)
    blocks.free([block])
    blocks.allocate(1)  # reused for other content: its hash and snapshot go
    assert pool.slot_of(b"a") is None and pool.num_free_slots == 2
    pool.check_consistency()
