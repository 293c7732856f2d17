"""Block pool, block tables and the prefix cache: ref counts, LRU reuse, hash chaining, hits."""

import os
import subprocess
import sys

import pytest
import torch

from stillcut.engine.kv_cache import BlockPool, KVCacheManager, block_extra_keys, hash_block
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.request import PlaceholderRange, Request

PAD = 99  # placeholder token id


def make_item(num_tokens: int, identifier: str, bidirectional: bool = False) -> MultiModalItem:
    return MultiModalItem(
        kind="image",
        embeds=torch.zeros(num_tokens, 1),
        coords=torch.zeros(num_tokens, 3, dtype=torch.long),
        grid_thw=(1, 2, 2),
        identifier=identifier,
        bidirectional=bidirectional,
    )


def make_request(request_id, token_ids, placed=(), salt=None) -> Request:
    """`placed`: (offset, item) pairs; the item's placeholders are written into the prompt."""
    token_ids = list(token_ids)
    for offset, item in placed:
        token_ids[offset : offset + item.num_tokens] = [PAD] * item.num_tokens
    return Request(
        request_id,
        token_ids,
        mm_items=[item for _, item in placed],
        mm_positions=[PlaceholderRange(offset, item.num_tokens) for offset, item in placed],
        cache_salt=salt,
    )


def prefill(kv: KVCacheManager, request: Request) -> int:
    """Compute the whole prompt as a scheduler would; returns the prefix-cache hit."""
    prefix = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens - prefix.num_tokens, prefix) is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return prefix.num_tokens


def assert_all_blocks_free(kv: KVCacheManager) -> None:
    kv.check_consistency()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


def test_block_pool_ref_counts_and_lru_free_order():
    pool = BlockPool(6)
    first, second = pool.allocate(2), pool.allocate(2)
    assert [b.block_id for b in first + second] == [0, 1, 2, 3]
    pool.touch(first[:1])  # shared by a second request
    pool.free(first)
    assert first[0].ref_cnt == 1 and first[1].ref_cnt == 0
    pool.cache(second[1], b"h")
    pool.free(reversed(second))  # second[1] first: it is evicted first
    pool.check_consistency()
    assert pool.lookup(b"h") is second[1]  # freed blocks stay findable
    # never-used blocks first, then in the order freed: least recently used first
    reused = pool.allocate(pool.num_free_blocks)
    assert [b.block_id for b in reused] == [4, 5, 1, 3, 2]
    assert pool.lookup(b"h") is None and second[1].block_hash is None  # evicted on reuse
    pool.free(reused + first[:1])
    pool.check_consistency()
    assert pool.num_free_blocks == 6


def test_touching_a_free_cached_block_takes_it_off_the_free_list():
    pool = BlockPool(3)
    block = pool.allocate(1)[0]
    pool.cache(block, b"h")
    pool.free([block])
    pool.touch([pool.lookup(b"h")])
    assert pool.num_free_blocks == 2 and block.ref_cnt == 1
    assert block not in pool.allocate(2)
    pool.check_consistency()


def test_hash_chaining():
    keys = (None, ())
    root = hash_block(None, [1, 2, 3, 4], keys)
    assert root == hash_block(None, (1, 2, 3, 4), keys)
    assert hash_block(root, [5, 6, 7, 8], keys) == hash_block(root, [5, 6, 7, 8], keys)
    assert hash_block(root, [5, 6, 7, 8], keys) != hash_block(None, [5, 6, 7, 8], keys)
    assert hash_block(None, [1, 2, 3, 4], (None, (("video-a", 0),))) != root
    assert len({hash_block(None, [1, 2, 3, 4], ("salt", ())), root}) == 2


def test_block_extra_keys_name_overlapping_items_and_their_offsets():
    request = make_request("r", range(16), [(2, make_item(3, "a")), (5, make_item(6, "b"))])
    assert block_extra_keys(request, 0, 4) == (None, (("a", 2),))
    assert block_extra_keys(request, 1, 4) == (None, (("a", -2), ("b", 1)))
    assert block_extra_keys(request, 2, 4) == (None, (("b", -3),))
    assert block_extra_keys(request, 3, 4) == (None, ())


def test_block_hashes_change_with_identifier_offset_and_salt():
    kv = KVCacheManager(8, block_size=4)
    base = kv.block_hashes(make_request("a", range(12), [(5, make_item(2, "x"))]))
    same = kv.block_hashes(make_request("b", range(12), [(5, make_item(2, "x"))]))
    other_media = kv.block_hashes(make_request("c", range(12), [(5, make_item(2, "y"))]))
    # all-placeholder blocks: tokens are equal, only the item's offset tells them apart
    shifted_a = kv.block_hashes(make_request("d", [PAD] * 12, [(0, make_item(12, "x"))]))
    shifted_b = kv.block_hashes(make_request("e", [PAD] * 12, [(1, make_item(11, "x"))]))
    salted = kv.block_hashes(make_request("f", range(12), [(5, make_item(2, "x"))], salt="s"))
    assert len(base) == 3 and base == same
    assert other_media[0] == base[0] and other_media[1:] != base[1:]
    assert other_media[2] != base[2]  # the chain carries the difference on
    assert all(a != b for a, b in zip(shifted_a, shifted_b, strict=True))
    assert all(a != b for a, b in zip(salted, base, strict=True))


# The same image twice in one prompt, its two placements sharing block 1 (block size 4). In
# one process both placements hold one item object; in the other each its own (as an encoder
# cache hit and a fresh encode give): the identifiers are equal strings, not one string.
_HASHES_IN_A_FRESH_PROCESS = """
import sys
import torch
from stillcut.engine.kv_cache import KVCacheManager
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.request import PlaceholderRange, Request

def image():
    identifier = "".join(["image-", "4f2a"])  # built at run time, as real identifiers are
    zeros = torch.zeros(3, 3, dtype=torch.long)
    return MultiModalItem("image", torch.zeros(3, 1), zeros, (1, 2, 2), identifier=identifier)

first = image()
items = [first, first] if sys.argv[1] == "shared" else [first, image()]
tokens = [5, 6, 99, 99, 99, 7, 99, 99, 99, 8, 9, 10, 11, 12]
places = [PlaceholderRange(2, 3), PlaceholderRange(6, 3)]
request = Request("r", tokens, items, places, cache_salt="tenant-1")
print(" ".join(h.hex() for h in KVCacheManager(8, block_size=4).block_hashes(request)))
"""


def test_block_hashes_are_the_same_in_two_processes():
    """Hashes must not depend on Python's per-process string hashing or on object identity,
    or a prefix cached by one worker (or before a restart) is never found by another."""
    runs = []
    for hash_seed, items in (("1", "shared"), ("2", "separate")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        command = [sys.executable, "-c", _HASHES_IN_A_FRESH_PROCESS, items]
        runs.append(subprocess.run(command, env=env, capture_output=True, text=True, check=True))
    first, second = (run.stdout.split() for run in runs)
    assert len(first) == 3 and len(set(first)) == 3
    assert first == second


def test_prefix_hit_reuses_full_blocks_and_never_the_whole_prompt():
    kv = KVCacheManager(16, block_size=4)
    first = make_request("first", range(10))
    assert prefill(kv, first) == 0
    first_blocks = list(first.block_ids)
    kv.free(first)
    longer = make_request("longer", [*range(10), 50, 51, 52])
    assert prefill(kv, longer) == 8
    assert longer.block_ids[:2] == first_blocks[:2]
    exact = make_request("exact", range(8))  # fully cached, but one token must be computed
    assert prefill(kv, exact) == 4
    assert kv.num_query_tokens == 10 + 13 + 8 and kv.num_hit_tokens == 8 + 4
    kv.free(longer)
    kv.free(exact)
    assert_all_blocks_free(kv)


def test_a_freed_request_is_evicted_from_its_last_block():
    kv = KVCacheManager(3, block_size=4)
    first = make_request("first", range(12))
    prefill(kv, first)
    first_blocks = list(first.block_ids)
    kv.free(first)
    other = make_request("other", range(50, 54))
    assert kv.allocate_slots(other, 4) == first_blocks[-1:]
    # the chain's head survives, so the prefix is still found
    assert kv.find_cached_prefix(make_request("again", range(12))).num_tokens == 8
    kv.free(other)
    assert_all_blocks_free(kv)


def test_other_media_with_equal_tokens_misses_from_its_first_placeholder_block():
    kv = KVCacheManager(16, block_size=4)
    tokens = list(range(20))
    first = make_request("first", tokens, [(6, make_item(8, "video-a"))])
    prefill(kv, first)
    same = make_request("same", tokens, [(6, make_item(8, "video-a"))])
    other = make_request("other", tokens, [(6, make_item(8, "video-b"))])
    assert kv.find_cached_prefix(same).num_tokens == 16
    assert kv.find_cached_prefix(other).num_tokens == 4  # block 1 holds the first placeholder
    kv.free(first)
    assert_all_blocks_free(kv)


@pytest.mark.parametrize(
    "placed, expected_hit",
    [
        ([(6, 12, False)], 16),
        ([(6, 12, True)], 4),  # hit ends inside [6, 18): back to the block below 6
        ([(2, 4, True), (6, 12, True)], 0),  # ... which lies inside [2, 6): back to 0
        ([(2, 4, True), (6, 12, False)], 16),
    ],
)
def test_hit_ending_inside_a_bidirectional_item_is_rounded_down(placed, expected_hit):
    kv = KVCacheManager(16, block_size=4)
    items = [(offset, make_item(n, f"item{offset}", bidi)) for offset, n, bidi in placed]
    first = make_request("first", range(20), items)
    prefill(kv, first)
    second = make_request("second", [*range(19), 77], items)  # only the last block differs
    assert prefill(kv, second) == expected_hit
    assert second.block_ids[: expected_hit // 4] == first.block_ids[: expected_hit // 4]
    kv.free(first)
    kv.free(second)
    assert_all_blocks_free(kv)


def test_allocate_never_partially_allocates():
    kv = KVCacheManager(4, block_size=4)
    cached = make_request("cached", range(9))
    prefill(kv, cached)  # 3 blocks, the first two full and hashed
    kv.free(cached)
    holder = make_request("holder", [40, 41, 42])
    assert kv.allocate_slots(holder, 3) is not None  # one block: 3 left, 2 of them cached
    again = make_request("again", [*range(8), 60, 61, 62, 63, 64])
    prefix = kv.find_cached_prefix(again)
    assert prefix.num_tokens == 8
    # needs 2 new blocks besides the 2 hits, but reusing the hits leaves only 1 free
    assert kv.allocate_slots(again, 5, prefix) is None
    assert again.block_ids == [] and kv.num_free_blocks == 3
    assert all(b.ref_cnt == 0 for b in prefix.blocks)
    assert kv.allocate_slots(holder, 17) is None and holder.block_ids == [3]
    assert kv.allocate_slots(again, 4, prefix) == [0, 1, 2]  # one new block suffices
    kv.free(holder)
    kv.free(again)
    assert_all_blocks_free(kv)


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    kv = KVCacheManager(4, block_size=4)
    request = make_request("r", range(9))
    prefill(kv, request)
    assert not kv.reset_prefix_cache()
    kv.free(request)
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(make_request("s", range(9))).num_tokens == 0
    assert_all_blocks_free(kv)
