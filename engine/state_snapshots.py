"""Recurrent-state snapshots: where a prefix-cache hit of a hybrid model may restart.

A recurrent layer (Mamba2) sums up every token before it in one state, so cached K/V alone
cannot resume a prompt: the state after the cached tokens is needed too. When a request's
prefill passes a restart point (a block boundary), the runner copies each recurrent layer's
state there into a snapshot slot, saved under the chained hash of the block ending there; a
later prompt whose cached chain reaches that block restores the slot and prefills from it
(DESIGN.md, "Cache groups"). Restart points are every `interval`-th full block and, so that
prompts shorter than `interval` blocks still hit, where later prompts are likely to diverge:
the last full block before the end of each multimodal item (a second question about the same
video), the last two full blocks of the prompt (the same context with another short question,
a repeated prompt, the next turn of a chat), and the end of the cached K/V a request shared
with an earlier prompt without a snapshot there (the point where the two diverged, so the next
prompt like them hits there).

The runner owns the slot tensors `[num_slots, *shape]`; this module decides which slot holds
what. Saved snapshots are evicted least recently used first when a new one needs a slot, and
with their block when the block pool reuses it. (A held prefix keeps its runner row, and so
its state, between extensions: it needs no snapshot of its own.)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from stillcut.engine.request import Request


class StateCapture(NamedTuple):
    """Save the recurrent state after `num_tokens` of a request's scheduled tokens this step
    into `slot`, under `block_hash`, the hash of the block ending there."""

    num_tokens: int
    slot: int
    block_hash: bytes


class SnapshotPool:
    """Snapshot slots: free, in flight (reserved this step), or saved by hash (LRU)."""

    def __init__(self, num_slots: int, interval: int) -> None:
        assert num_slots >= 1 and interval >= 1, (num_slots, interval)
        self.num_slots = num_slots
        self.interval = interval
        self._free = list(range(num_slots - 1, -1, -1))
        self._saved: OrderedDict[bytes, int] = OrderedDict()  # first = least recently used
        self._in_flight: set[bytes] = set()
        self.num_saved = 0
        self.num_restored = 0
        self.num_evicted = 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def has(self, block_hash: bytes) -> bool:
        """Whether a snapshot is saved (or being saved this step) under `block_hash`."""
        return block_hash in self._saved or block_hash in self._in_flight

    def slot_of(self, block_hash: bytes) -> int | None:
        return self._saved.get(block_hash)

    def saved_hashes(self) -> list[bytes]:
        return list(self._saved)

    def restore(self, block_hash: bytes) -> int:
        """The slot a prefix-cache hit restores; it becomes the most recently used."""
        self._saved.move_to_end(block_hash)
        self.num_restored += 1
        return self._saved[block_hash]

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to save the state at `block_hash` into this step: a free one, else the least
        recently used saved one (evicted). None when every slot is in flight."""
        slot = self._take_slot()
        if slot is not None:
            self._in_flight.add(block_hash)
        return slot

    def commit(self, capture: StateCapture, block_cached: bool) -> None:
        """After the step: keep the captured state if its block is in the prefix cache."""
        self._in_flight.discard(capture.block_hash)
        if block_cached:
            self._saved[capture.block_hash] = capture.slot
            self.num_saved += 1
        else:
            self._free.append(capture.slot)

    def drop(self, block_hash: bytes) -> None:
        """The block holding `block_hash` left the prefix cache: its snapshot goes with it."""
        slot = self._saved.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)
            self.num_evicted += 1

    def clear(self) -> None:
        """Forget every saved snapshot (with the prefix cache)."""
        self._free.extend(self._saved.values())
        self._saved.clear()

    def check_consistency(self) -> None:
        """Every slot is exactly one of free or saved (in flight only inside a step)."""
        assert not self._in_flight, self._in_flight
        slots = [*self._free, *self._saved.values()]
        assert sorted(slots) == list(range(self.num_slots)), slots

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._saved:
            return None
        _, slot = self._saved.popitem(last=False)
        self.num_evicted += 1
        return slot


def restart_blocks(
    request: Request, start: int, end: int, block_size: int, interval: int, num_shared_blocks: int
) -> list[int]:
    """Block counts `j` with `start < j * block_size <= end` whose boundary is a restart point
    of the request (module docstring); `num_shared_blocks` is how many of its leading blocks
    it found in the cache's K/V when it started."""
    first, last = start // block_size + 1, end // block_size
    if first > last:  # most decode steps: no block fills
        return []
    num_prompt_blocks = request.num_prompt_tokens // block_size
    ends = {num_prompt_blocks, num_prompt_blocks - 1, num_shared_blocks}
    ends.update(place.end // block_size for place in request.mm_positions)
    return [j for j in range(first, last + 1) if j % interval == 0 or j in ends]
