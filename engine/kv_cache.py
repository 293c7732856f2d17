"""Paged-KV bookkeeping: ref-counted blocks, per-request block tables and the prefix cache.

The runner owns the KV tensors `[num_blocks, block_size, ...]`; this module only decides which
block ids each request writes. Blocks are shared by ref count. A block freed with a hash keeps
it, and stays findable, until the LRU free list hands it out for something else, so a prefix
computed by a finished or held request is reused by any later prompt that starts the same way.
Only full blocks are hashed. A block's hash chains its parent's hash, its token ids, every mm
item overlapping it as `(identifier, item start - block start)`, and the cache salt in the
first block only: the chain carries the salt into every later block. For a model with
recurrent layers a hit must also restore their state, so it stops at the deepest cached block
that has a state snapshot (`state_snapshots`); a block reused for other content takes its
snapshot with it.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from stillcut.engine.request import Request, RequestStatus
from stillcut.engine.state_snapshots import SnapshotPool, StateCapture, restart_blocks


@dataclass(slots=True, eq=False)
class Block:
    """One KV block. `block_hash` is set only while the prefix cache maps that hash to it."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """All blocks, the free list in LRU order, and the hash -> block map of the prefix cache."""

    def __init__(
        self, num_blocks: int, on_evict: Callable[[bytes], None] = lambda block_hash: None
    ) -> None:
        """`on_evict(block_hash)` is told of every hash that leaves the cache by reuse."""
        assert num_blocks >= 1, num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._on_evict = on_evict
        # head = least recently freed = first to be handed out; O(1) pop, append and remove
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` from the head of the free list, evicting their cached hashes."""
        assert num_blocks <= len(self._free), (num_blocks, len(self._free))
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                self._on_evict(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference to each (cache-hit) block, out of the free list if need be."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each; blocks reaching zero join the tail of the free list in
        the order given, so the first given is the first evicted."""
        for block in blocks:
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Make `block` findable by `block_hash`, unless another block already holds that
        content (two requests computed it at once); the duplicate then stays unhashed."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if len(self._free) != len(self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def check_consistency(self) -> None:
        """Assert the pool's invariants (for tests and debugging)."""
        assert set(self._free) == {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        hashed = {b.block_hash: b for b in self.blocks if b.block_hash is not None}
        assert len(hashed) == len(self._cached)
        assert all(self._cached.get(h) is b for h, b in hashed.items())


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
    """sha256 of a block's content and its parent's hash.

    Every part is written in one fixed layout (counts and lengths before what they count), so
    equal content hashes equally in every process: no Python `hash()`, whose strings differ
    per process, and no pickle, whose bytes depend on which equal strings are one object.
    """
    salt, items = extra_keys
    digest = hashlib.sha256(parent if parent is not None else _NO_PARENT)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    digest.update(_encoded(salt) + struct.pack("<I", len(items)))
    for identifier, offset in items:
        digest.update(_encoded(identifier) + struct.pack("<q", offset))
    return digest.digest()


_NO_PARENT = bytes(32)  # a first block's parent: no sha256 digest is all zeros in practice


def _encoded(text: str | None) -> bytes:
    """None, or a string as its UTF-8 length and bytes: no two values encode alike."""
    if text is None:
        return b"\0"
    data = text.encode()
    return b"\1" + struct.pack("<I", len(data)) + data


def block_extra_keys(request: Request, block_index: int, block_size: int) -> tuple:
    """What besides token ids tells this block's content: the salt (first block only) and each
    overlapping item's identifier with its start relative to the block (may be negative)."""
    start, end = block_index * block_size, (block_index + 1) * block_size
    places = request.mm_positions
    items = []
    # placements are sorted and disjoint: the overlapping ones start at the first ending after
    for index in range(bisect.bisect_right(places, start, key=lambda p: p.end), len(places)):
        if places[index].offset >= end:
            break
        items.append((request.mm_items[index].identifier, places[index].offset - start))
    return (request.cache_salt if block_index == 0 else None, tuple(items))


class CachedPrefix(NamedTuple):
    """A prefix-cache hit: the blocks holding the first `num_tokens` tokens of a request, and
    the hash of the last one, under which the recurrent state after them is saved (None for a
    model without recurrent layers, or no hit)."""

    blocks: tuple[Block, ...]
    num_tokens: int
    restart_hash: bytes | None = None


NO_PREFIX = CachedPrefix((), 0)


class KVCacheManager:
    """Block tables of the live requests, on top of one `BlockPool`.

    Per step the scheduler asks `find_cached_prefix` (first schedule only) and `allocate_slots`;
    after the step `cache_full_blocks` registers what became full; `free` ends a request's
    claim. Counters `num_query_tokens` / `num_hit_tokens` measure the prefix cache in tokens,
    once per request: at its first allocation, not again when it resumes after preemption.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        snapshots: SnapshotPool | None = None,
    ) -> None:
        """`snapshots`: the recurrent-state snapshots of a model with recurrent layers."""
        self.snapshots = snapshots
        on_evict = snapshots.drop if snapshots is not None else lambda block_hash: None
        self.block_pool = BlockPool(num_blocks, on_evict)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self._req_blocks: dict[str, list[Block]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already registered
        self._num_shared_blocks: dict[str, int] = {}  # leading blocks found in K/V at start

    @property
    def num_blocks(self) -> int:
        return len(self.block_pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any request (cached ones included: they can be reused)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest chain of cached full blocks from the request's first token.

        At least one token is left to compute so the runner has logits, a hit ending inside a
        bidirectional item is rounded down to the block boundary below its start, and with
        recurrent layers it is rounded down to the deepest block with a state snapshot.
        """
        if not self.enable_prefix_caching:
            return NO_PREFIX
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request)
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_blocks = len(blocks)
        if self.snapshots is not None:
            self._num_shared_blocks[request.request_id] = num_blocks
        # each rounding may land where the other does not hold: repeat until both do
        while (rounded := self._restart_at_or_before(request, num_blocks, hashes)) != num_blocks:
            num_blocks = rounded
        restart_hash = hashes[num_blocks - 1] if self.snapshots is not None and num_blocks else None
        return CachedPrefix(tuple(blocks[:num_blocks]), num_blocks * self.block_size, restart_hash)

    def _restart_at_or_before(self, request: Request, num_blocks: int, hashes) -> int:
        """The most leading blocks, at most `num_blocks`, a hit may end after: not inside a
        bidirectional item, and (recurrent layers) at a saved state snapshot."""
        size = self.block_size
        num_blocks = request.chunk_end_at_or_before(num_blocks * size) // size
        if self.snapshots is not None:
            while num_blocks and self.snapshots.slot_of(hashes[num_blocks - 1]) is None:
                num_blocks -= 1
        return num_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX
    ) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens after its computed ones
        (and after `prefix`, a hit found for it this step). Returns the block ids added to its
        table, or None, changing nothing, when the free blocks do not suffice."""
        assert num_new_tokens > 0, num_new_tokens
        blocks = self._req_blocks.get(request.request_id, [])
        assert not prefix.blocks or not blocks, "a prefix is only reused by a fresh table"
        num_tokens = request.num_computed_tokens + prefix.num_tokens + num_new_tokens
        num_needed = max(0, self.num_blocks_for(num_tokens) - len(blocks) - len(prefix.blocks))
        # hit blocks sitting in the free list stop being free once reused
        num_free = self.num_free_blocks - sum(b.ref_cnt == 0 for b in prefix.blocks)
        if num_needed > num_free:
            return None
        if not blocks and self.enable_prefix_caching:
            if request.status is RequestStatus.WAITING:  # a preempted one was counted already
                self.num_query_tokens += request.num_tokens
                self.num_hit_tokens += prefix.num_tokens
            self._num_cached_blocks[request.request_id] = len(prefix.blocks)
        self.block_pool.touch(prefix.blocks)
        added = [*prefix.blocks, *self.block_pool.allocate(num_needed)]
        self._req_blocks.setdefault(request.request_id, []).extend(added)
        request.block_ids.extend(b.block_id for b in added)
        return [b.block_id for b in added]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks that `request.num_computed_tokens` has filled since last time."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        num_cached = self._num_cached_blocks.get(request_id, 0)
        blocks, hashes = self._req_blocks[request_id], self.block_hashes(request)
        for index in range(num_cached, num_full):
            self.block_pool.cache(blocks[index], hashes[index])
        self._num_cached_blocks[request_id] = max(num_cached, num_full)

    def restored_state_slot(self, prefix: CachedPrefix) -> int | None:
        """The snapshot slot a request starting from `prefix` restores its recurrent state
        from; None when it starts from zeros (or the model has no recurrent layers)."""
        if self.snapshots is None or prefix.restart_hash is None:
            return None
        return self.snapshots.restore(prefix.restart_hash)

    def plan_state_captures(self, request: Request, num_new_tokens: int) -> list[StateCapture]:
        """Where this step saves the request's recurrent state: at each restart point among
        its next `num_new_tokens` tokens that has no snapshot yet."""
        if self.snapshots is None or not self.enable_prefix_caching:
            return []
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
        captures, size, hashes = [], self.block_size, self.block_hashes(request)
        num_shared = self._num_shared_blocks.get(request.request_id, 0)
        for j in restart_blocks(request, start, end, size, self.snapshots.interval, num_shared):
            if self.snapshots.has(hashes[j - 1]):
                continue
            slot = self.snapshots.reserve(hashes[j - 1])
            if slot is None:
                break
            captures.append(StateCapture(j * size - start, slot, hashes[j - 1]))
        return captures

    def commit_state_captures(self, captures: Iterable[StateCapture]) -> None:
        """After the step: keep each captured state whose block is now in the prefix cache."""
        for capture in captures:
            self.snapshots.commit(capture, self.block_pool.lookup(capture.block_hash) is not None)

    def free(self, request: Request) -> None:
        """Release every block of the request; hashed ones stay findable until reused."""
        blocks = self._req_blocks.pop(request.request_id, [])
        # last blocks first: they are the least likely to be shared, so they are evicted first
        self.block_pool.free(reversed(blocks))
        request.block_ids.clear()
        self._block_hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_shared_blocks.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes and their state snapshots (after a weight reload); False
        while blocks are in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.snapshots is not None:
            self.snapshots.clear()
        return True

    def check_consistency(self) -> None:
        """Assert that every block's ref count equals the number of tables holding it, and
        that every saved state snapshot belongs to a cached block."""
        self.block_pool.check_consistency()
        if self.snapshots is not None:
            self.snapshots.check_consistency()
            saved = self.snapshots.saved_hashes()
            assert all(self.block_pool.lookup(h) is not None for h in saved)
        holders = Counter(b.block_id for blocks in self._req_blocks.values() for b in blocks)
        assert all(b.ref_cnt == holders[b.block_id] for b in self.block_pool.blocks)

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of all full blocks of the request's tokens, extended as the tokens grow:
        only the blocks that filled since the last call are read and hashed."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        size = self.block_size
        for index in range(len(hashes), request.num_tokens // size):
            token_ids = request.token_ids_between(index * size, (index + 1) * size)
            extra_keys = block_extra_keys(request, index, size)
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids, extra_keys))
        return hashes
