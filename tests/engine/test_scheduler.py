"""Scheduler: budgets, chunked prefill, bidirectional items, preemption, aborts, held prefixes.

A fake runner stands in for the model. It keeps one "KV" value per cache slot: a digest of the
request's content up to that position (token ids, and the identifier of the item at each
placeholder), as real deep-layer KV depends on the whole prefix. Each step it writes the
scheduled positions into the slots the block table names and reads back every earlier one, so
a block with two owners, a wrong prefix hit or a lost block fails the read. It samples the
next token from the digest, so outputs depend only on the content and must not change with
preemption or caching.
"""

import hashlib
import random
from dataclasses import dataclass

import pytest
import torch

from stillcut.engine.admission import (
    BidirectionalItemTooLong,
    RequestTooLong,
    ResourceExhausted,
    TooManyVisualTokens,
)
from stillcut.engine.config import CacheConfig, SchedulerConfig
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.request import PlaceholderRange, Request, RequestStatus, SamplingParams
from stillcut.engine.scheduler import Scheduler

PAD = 99  # placeholder token id
BLOCK = 4


def make_item(num_tokens: int, identifier: str, bidirectional: bool = False) -> MultiModalItem:
    return MultiModalItem(
        kind="image",
        embeds=torch.zeros(num_tokens, 1),
        coords=torch.zeros(num_tokens, 3, dtype=torch.long),
        grid_thw=(1, 2, 2),
        identifier=identifier,
        bidirectional=bidirectional,
    )


def make_request(request_id, token_ids, max_tokens=4, placed=(), params=None, **kwargs) -> Request:
    """`placed`: (offset, item) pairs; the item's placeholders are written into the prompt."""
    token_ids = list(token_ids)
    for offset, item in placed:
        token_ids[offset : offset + item.num_tokens] = [PAD] * item.num_tokens
    return Request(
        request_id,
        token_ids,
        mm_items=[item for _, item in placed],
        mm_positions=[PlaceholderRange(offset, item.num_tokens) for offset, item in placed],
        sampling_params=params or SamplingParams(max_tokens=max_tokens),
        **kwargs,
    )


def make_scheduler(num_blocks=64, held_share=0.0, prefix_caching=True, **config) -> Scheduler:
    cache = CacheConfig(
        block_size=BLOCK, held_share=held_share, enable_prefix_caching=prefix_caching
    )
    return Scheduler(SchedulerConfig(**config), cache, num_blocks=num_blocks)


def digest(parent: bytes, content: tuple) -> bytes:
    return hashlib.sha256(parent + repr(content).encode()).digest()


@dataclass
class Row:
    token_ids: list[int]
    items: list[MultiModalItem]
    positions: list[PlaceholderRange]
    block_ids: list[int]
    num_computed: int
    hold: bool

    def digests(self) -> list[bytes]:
        content = [(t,) for t in self.token_ids]
        for item, place in zip(self.items, self.positions, strict=True):
            for index in range(place.length):
                content[place.offset + index] = (PAD, item.identifier, index)
        chain, parent = [], b""
        for entry in content:
            parent = digest(parent, entry)
            chain.append(parent)
        return chain


class FakeRunner:
    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], bytes] = {}
        self.rows: dict[str, Row] = {}

    def step(self, output) -> dict[str, list[int]]:
        for request_id in output.finished_ids + output.preempted_ids:
            self.rows.pop(request_id, None)
        for new in output.scheduled_new:
            self.rows[new.request_id] = Row(
                new.all_token_ids,
                new.mm_items,
                new.mm_positions,
                list(new.block_ids),
                new.num_computed_tokens,
                new.hold,
            )
        for cached in output.scheduled_cached:
            row = self.rows[cached.request_id]
            assert row.num_computed == cached.num_computed_tokens
            for appended in cached.appended:  # the new part only, after the tokens kept
                row.token_ids = row.token_ids[: appended.start] + appended.token_ids
                row.items = [*row.items, *appended.mm_items]
                row.positions = [*row.positions, *appended.mm_positions]
            row.block_ids.extend(cached.new_block_ids)
        return {
            request_id: sampled
            for request_id, num_tokens in output.num_scheduled_tokens.items()
            if (sampled := self._forward(request_id, num_tokens))
        }

    def _forward(self, request_id: str, num_tokens: int) -> list[int]:
        row = self.rows[request_id]
        start, end = row.num_computed, row.num_computed + num_tokens
        for item, place in zip(row.items, row.positions, strict=True):
            if item.bidirectional:
                assert not place.offset < start < place.end, f"{request_id} splits an item"
                assert not place.offset < end < place.end, f"{request_id} splits an item"
        chain = row.digests()
        for position in range(start, end):
            self.slots[self._slot(row, position)] = chain[position]
        for position in range(end):
            assert self.slots[self._slot(row, position)] == chain[position], (
                f"{request_id} reads wrong KV at position {position}"
            )
        row.num_computed = end
        if end < len(row.token_ids) or row.hold:
            return []
        token = 1 + chain[end - 1][0] % 50
        row.token_ids.append(token)
        return [token]

    @staticmethod
    def _slot(row: Row, position: int) -> tuple[int, int]:
        return row.block_ids[position // BLOCK], position % BLOCK


def step(scheduler, runner, outputs=None, between=None):
    """One schedule -> run -> update round, checking the step's limits."""
    running_before = [r.request_id for r in scheduler.running]
    output = scheduler.schedule()
    config = scheduler.config
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(output.num_scheduled_tokens) <= config.max_num_seqs
    assert all(n >= 1 for n in output.num_scheduled_tokens.values())
    # victims are the newest running requests not scheduled this step
    unscheduled = [r for r in reversed(running_before) if r not in output.num_scheduled_tokens]
    assert output.preempted_ids == unscheduled[: len(output.preempted_ids)]
    # and they resume first, the oldest victim first
    resuming = [r.request_id for r in list(scheduler.waiting)[: len(output.preempted_ids)]]
    assert resuming == output.preempted_ids[::-1]
    if between is not None:
        between(output)
    sampled = runner.step(output)
    for update in scheduler.update_from_output(output, sampled):
        if outputs is not None:
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    scheduler.kv_cache.check_consistency()
    return output


def run_all(scheduler, runner, max_steps=500):
    outputs, scheduled, preempted, resumed = {}, {}, [], []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs, scheduled, preempted, resumed
        output = step(scheduler, runner, outputs)
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            scheduled.setdefault(request_id, []).append(num_tokens)
        preempted += output.preempted_ids
        resumed += [new for new in output.scheduled_new if new.output_token_ids]
    raise AssertionError("requests did not finish")


def assert_all_blocks_free(scheduler) -> None:
    kv = scheduler.kv_cache
    kv.check_consistency()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


def random_requests(seed, num_requests, shared_prefix=()):
    rng = random.Random(seed)
    return [
        make_request(
            f"r{i}",
            [*shared_prefix, *(rng.randrange(1, 60) for _ in range(rng.randrange(3, 15)))],
            max_tokens=rng.randrange(1, 14),
        )
        for i in range(num_requests)
    ]


def test_chunked_prefill_sums_to_the_prompt_within_budget_and_seats():
    scheduler = make_scheduler(max_num_batched_tokens=7, max_num_seqs=3)
    requests = random_requests(0, 8)
    for request in requests:
        scheduler.add_request(request)
    outputs, scheduled, _, _ = run_all(scheduler, FakeRunner())
    for request in requests:
        assert len(outputs[request.request_id]) == request.sampling_params.max_tokens
        # the prompt once, then one token per output but the last (never fed back)
        num_prompt = request.num_prompt_tokens
        assert (
            sum(scheduled[request.request_id]) == num_prompt + len(outputs[request.request_id]) - 1
        )
        assert request.status is RequestStatus.FINISHED_LENGTH
    assert max(len(s) for s in scheduled.values()) > 2  # prompts really were chunked
    assert_all_blocks_free(scheduler)


def test_decodes_are_scheduled_before_prefill_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=9)
    item = make_item(8, "photo", bidirectional=True)
    long = make_request("long", range(1, 41), max_tokens=1, placed=[(2, item)])
    short = make_request("short", [1, 2, 3], max_tokens=5)
    scheduler.add_request(long)
    scheduler.add_request(short)
    runner = FakeRunner()
    first = step(scheduler, runner)
    assert first.num_scheduled_tokens == {"long": 2, "short": 3}  # long stops before its item
    for _ in range(4):
        output = step(scheduler, runner)
        # `long` joined the running queue first, yet `short` decodes first every step
        assert output.scheduled_cached[0].request_id == "short"
        assert output.num_scheduled_tokens["short"] == 1
        assert output.total_num_scheduled_tokens == 9
    run_all(scheduler, runner)
    assert_all_blocks_free(scheduler)


def test_bidirectional_item_is_never_split_even_at_exactly_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    item = make_item(8, "photo", bidirectional=True)
    scheduler.add_request(make_request("r", range(1, 17), max_tokens=2, placed=[(3, item)]))
    _, scheduled, _, _ = run_all(scheduler, FakeRunner())
    assert scheduled["r"] == [3, 8, 5, 1]
    assert_all_blocks_free(scheduler)


def test_many_bidirectional_items_in_random_prompts_are_never_split():
    scheduler = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4)
    rng = random.Random(1)
    for i in range(6):
        placed, cursor = [], rng.randrange(0, 3)
        for k in range(3):
            item = make_item(rng.randrange(1, 11), f"img{i}.{k}", bidirectional=True)
            placed.append((cursor, item))
            cursor += item.num_tokens + rng.randrange(0, 3)
        scheduler.add_request(make_request(f"r{i}", range(1, cursor + 2), 3, placed))
    run_all(scheduler, FakeRunner())  # the runner asserts no chunk ends inside an item
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_every_output_the_same(prefix_caching):
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    reference = make_scheduler(num_blocks=400, prefix_caching=prefix_caching)
    tight = make_scheduler(num_blocks=10, prefix_caching=prefix_caching, max_num_seqs=8)
    for scheduler in (reference, tight):
        for request in random_requests(2, 10, shared):
            scheduler.add_request(request)
    expected, _, none, _ = run_all(reference, FakeRunner())
    outputs, _, preempted, resumed = run_all(tight, FakeRunner())
    assert not none and len(preempted) >= 3
    # resumed after generating tokens: those are recomputed, from the cache where it can
    assert len(resumed) >= 3
    hits = [new.num_computed_tokens for new in resumed]
    assert any(hits) if prefix_caching else not any(hits)
    assert outputs == expected
    assert_all_blocks_free(tight)
    assert_all_blocks_free(reference)


def abort_scenario():
    scheduler = make_scheduler(
        num_blocks=8, held_share=0.25, max_num_batched_tokens=8, max_num_seqs=4
    )
    scheduler.add_request(make_request("old", range(1, 7), max_tokens=14))
    scheduler.add_request(make_request("target", range(1, 11), max_tokens=10))
    scheduler.add_request(make_request("held", range(20, 26), hold=True))
    return scheduler


STATES = {
    "waiting": ("target", lambda r: r.status is RequestStatus.WAITING),
    "prefill": ("target", lambda r: r.status is RequestStatus.RUNNING and r.num_computed_tokens),
    "decode": ("target", lambda r: len(r.output_token_ids) >= 2),
    "preempted": ("target", lambda r: r.status is RequestStatus.PREEMPTED),
    "held": ("held", lambda r: r.status is RequestStatus.HELD),
}


@pytest.mark.parametrize("state", STATES)
def test_abort_in_any_state_frees_its_blocks(state):
    scheduler, runner = abort_scenario(), FakeRunner()
    request_id, reached = STATES[state]
    request = scheduler.requests[request_id]
    for _ in range(50):
        if reached(request):
            break
        step(scheduler, runner)
    assert reached(request), state
    assert scheduler.abort(request_id)
    assert request.status is RequestStatus.FINISHED_ABORTED and request.block_ids == []
    assert not scheduler.abort(request_id)
    assert request_id in step(scheduler, runner).finished_ids
    scheduler.abort("held")
    run_all(scheduler, runner)
    assert_all_blocks_free(scheduler)


def test_abort_while_the_step_runs_drops_its_result():
    scheduler, runner = abort_scenario(), FakeRunner()
    step(scheduler, runner)
    output = step(scheduler, runner, between=lambda out: scheduler.abort("target"))
    assert "target" in output.num_scheduled_tokens
    assert "target" not in scheduler.requests
    assert "target" in step(scheduler, runner).finished_ids
    scheduler.abort("held")
    run_all(scheduler, runner)
    assert_all_blocks_free(scheduler)


def test_stop_conditions_and_the_finish_hook():
    scheduler = make_scheduler()
    requests = {
        "eos": make_request("eos", [1, 2], eos_token_ids=(5,)),
        "ignore": make_request(
            "ignore", [1, 2], params=SamplingParams(8, ignore_eos=True), eos_token_ids=(5,)
        ),
        "stop_id": make_request("stop_id", [1, 2], params=SamplingParams(8, stop_token_ids=(7,))),
        "length": make_request("length", [1, 2], max_tokens=2),
        "hook": make_request("hook", [1, 2]),
    }
    for request in requests.values():
        scheduler.add_request(request)
    output = scheduler.schedule()
    sampled = {"eos": [3, 5, 6], "ignore": [5], "stop_id": [7], "length": [1, 2, 3], "hook": [4]}
    updates = {u.request_id: u for u in scheduler.update_from_output(output, sampled)}
    assert updates["eos"].new_token_ids == [3, 5] and updates["eos"].finished
    assert updates["eos"].status is RequestStatus.FINISHED_STOPPED
    assert updates["eos"].stop_reason is None  # EOS is no stop token, as OpenAI reports it
    assert updates["ignore"].status is RequestStatus.RUNNING
    assert updates["stop_id"].status is RequestStatus.FINISHED_STOPPED
    assert updates["stop_id"].stop_reason == 7
    assert updates["length"].new_token_ids == [1, 2]
    assert updates["length"].status is RequestStatus.FINISHED_LENGTH
    # a stop string matched downstream
    assert scheduler.finish_request("hook", RequestStatus.FINISHED_STOPPED)
    assert set(scheduler.schedule().finished_ids) == {"eos", "stop_id", "length", "hook"}
    assert scheduler.num_running == 1
    scheduler.abort("ignore")
    assert_all_blocks_free(scheduler)


VISION_START, VISION_END = 90, 91


def tubelet(index: int, num_tokens: int) -> MultiModalItem:
    return make_item(num_tokens, f"session/{index}")


def placed_items(request: Request) -> list:
    return [
        (p.offset, item) for item, p in zip(request.mm_items, request.mm_positions, strict=True)
    ]


def test_held_prefix_extends_forks_and_releases():
    scheduler, runner = make_scheduler(held_share=0.5, max_num_batched_tokens=64), FakeRunner()
    live = make_request("live", [1, 2, 3, VISION_START, *[PAD] * 6], placed=[(4, tubelet(0, 6))])
    live.hold = True
    scheduler.add_request(live)
    assert step(scheduler, runner).num_scheduled_tokens == {"live": 10}
    assert live.status is RequestStatus.HELD and len(live.block_ids) == 3
    assert not scheduler.has_unfinished_requests() and scheduler.num_held == 1
    assert scheduler.kv_cache.num_free_blocks == 64 - 3
    for index, (num_text, num_pad) in enumerate([(0, 5), (1, 7), (2, 6)], start=1):
        blocks_before, num_before = list(live.block_ids), live.num_prompt_tokens
        new_token_ids = [50 + index] * num_text + [PAD] * num_pad
        placement = PlaceholderRange(num_text, num_pad)
        scheduler.append_input("live", new_token_ids, [tubelet(index, num_pad)], [placement])
        output = step(scheduler, runner)
        # only the new tokens are prefilled, into the same partial last block first; the
        # runner keeps the row and is told only the new part
        assert output.num_scheduled_tokens == {"live": len(new_token_ids)}
        assert not output.scheduled_new and not output.finished_ids
        (cached,) = output.scheduled_cached
        assert cached.num_computed_tokens == num_before
        (appended,) = cached.appended
        assert appended.start == num_before and appended.token_ids == new_token_ids
        assert appended.mm_positions == [(num_before + num_text, num_pad)]
        assert live.block_ids[: len(blocks_before)] == blocks_before
        assert live.status is RequestStatus.HELD
    assert live.num_prompt_tokens == 31 and len(live.block_ids) == 8

    question = [VISION_END, 60, 61, 62, 63]
    forks = [
        make_request(f"q{i}", [*live.prompt_token_ids, *question, 70 + i], 3, placed_items(live))
        for i in range(2)
    ]
    for fork in forks:
        scheduler.add_request(fork)
    output = step(scheduler, runner)
    num_full = 28  # the held prefix's full blocks
    for fork in forks:
        assert fork.num_cached_tokens == num_full
        assert fork.block_ids[:7] == live.block_ids[:7]
        assert output.num_scheduled_tokens[fork.request_id] <= len(question) + 1 + BLOCK
    scheduler.release_held("live")  # the forks keep the blocks they share
    assert live.status is RequestStatus.FINISHED_STOPPED
    run_all(scheduler, runner)
    assert_all_blocks_free(scheduler)

    alone = make_scheduler()
    for fork in forks:
        alone.add_request(
            make_request(fork.request_id, fork.prompt_token_ids, 3, placed_items(fork))
        )
    expected, _, _, _ = run_all(alone, FakeRunner())
    assert {fork.request_id: fork.output_token_ids for fork in forks} == expected


def test_held_requests_are_never_preempted():
    scheduler, runner = (
        make_scheduler(num_blocks=10, held_share=0.4, max_num_batched_tokens=4),
        FakeRunner(),
    )
    requests = [make_request("o1", range(1, 5), 20), make_request("o2", range(5, 9), 8)]
    live = make_request("live", range(20, 36), hold=True)
    for request in [*requests, live]:
        scheduler.add_request(request)
    skipped = 0
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        order = [r.request_id for r in scheduler.running]
        output = step(scheduler, runner)
        assert "live" not in output.preempted_ids
        # the newest running request is the held one, so the victim was found behind it
        skipped += bool(output.preempted_ids) and order[-1] == "live"
    assert skipped and live.status is RequestStatus.HELD
    reference = make_scheduler()
    for request in requests:
        reference.add_request(
            make_request(
                request.request_id, request.prompt_token_ids, request.sampling_params.max_tokens
            )
        )
    expected, _, _, _ = run_all(reference, FakeRunner())
    assert {r.request_id: r.output_token_ids for r in requests} == expected
    scheduler.release_held("live")
    assert_all_blocks_free(scheduler)


def test_held_share_is_enforced():
    scheduler = make_scheduler(num_blocks=16, held_share=0.5)  # 8 blocks for held prefixes
    first = make_request("first", range(1, 21), hold=True)  # 5 blocks
    small = make_request("small", range(1, 5), hold=True)  # 1 block
    scheduler.add_request(first)
    scheduler.add_request(small)
    with pytest.raises(ResourceExhausted, match=r"pin 10 of 16 KV blocks, over held_share=0.5"):
        scheduler.add_request(make_request("second", range(1, 17), hold=True))
    with pytest.raises(RequestTooLong, match="a held prefix may use at most 8"):
        scheduler.add_request(make_request("huge", range(1, 34), hold=True))
    with pytest.raises(RequestTooLong, match="a request may use at most 8"):
        scheduler.add_request(make_request("big", range(1, 30), max_tokens=4))
    runner = FakeRunner()
    step(scheduler, runner)
    with pytest.raises(ResourceExhausted):
        scheduler.append_input("first", range(40, 52))  # 32 tokens: 8 blocks, 9 with `small`
    assert first.num_prompt_tokens == 20 and first.status is RequestStatus.HELD
    scheduler.release_held("small")
    with pytest.raises(RequestTooLong):
        scheduler.append_input("first", range(40, 53))  # 33 tokens: 9 blocks, never possible
    scheduler.append_input("first", range(40, 52))
    step(scheduler, runner)
    assert len(first.block_ids) == 8 and first.status is RequestStatus.HELD
    scheduler.release_held("first")
    scheduler.add_request(make_request("second", range(1, 17), hold=True))
    step(scheduler, runner)
    scheduler.abort("second")
    assert_all_blocks_free(scheduler)


def test_only_a_held_request_can_be_extended_or_released():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("plain", [1, 2, 3]))
    with pytest.raises(ValueError, match="'plain' is not live .* only to a held prefix or a"):
        scheduler.append_input("plain", [4])
    with pytest.raises(ValueError, match="'gone' is unknown"):
        scheduler.release_held("gone")
    scheduler.abort("plain")
    assert_all_blocks_free(scheduler)


def test_admission_errors_name_the_numbers_and_change_nothing():
    scheduler = make_scheduler(
        max_model_len=32, max_visual_tokens_per_request=16, max_num_batched_tokens=8
    )
    two_items = [(0, make_item(10, "x")), (12, make_item(10, "y"))]
    cases = [
        (make_request("a", range(1, 31), max_tokens=10), RequestTooLong,
         r"prompt \(30 tokens\) \+ max_tokens \(10\) exceeds max_model_len=32"),
        (make_request("b", range(1, 25), placed=two_items),
         TooManyVisualTokens, "20 visual tokens exceed max_visual_tokens_per_request=16"),
        (make_request("c", range(1, 12), placed=[(1, make_item(9, "x", bidirectional=True))]),
         BidirectionalItemTooLong, "has 9 tokens .* max_num_batched_tokens=8"),
    ]  # fmt: skip
    for request, error, message in cases:
        with pytest.raises(error, match=message):
            scheduler.add_request(request)
    assert issubclass(RequestTooLong, ValueError) and issubclass(TooManyVisualTokens, ValueError)
    assert scheduler.num_waiting == 0 and not scheduler.requests
    # a causal item of the same size is fine: it may be split
    scheduler.add_request(make_request("d", range(1, 12), placed=[(1, make_item(9, "x"))]))
    with pytest.raises(ValueError, match="'d' is already in use"):
        scheduler.add_request(make_request("d", [1]))
    run_all(scheduler, FakeRunner())
    assert_all_blocks_free(scheduler)


def advance(scheduler) -> None:
    """One step without a model: every request that finishes its tokens samples token 1."""
    output = scheduler.schedule()
    sampled = {
        request_id: [1]
        for request_id, num_tokens in output.num_scheduled_tokens.items()
        if (request := scheduler.requests[request_id]).num_computed_tokens + num_tokens
        == request.num_tokens
        and not request.hold
    }
    scheduler.update_from_output(output, sampled)


def test_a_bidirectional_item_runs_while_decodes_fill_the_budget_and_requests_arrive():
    # 256-token images, a 300-token budget: with 45 decodes running an image no longer fits
    # beside them, and arriving requests would keep the decodes at 45 or more forever
    scheduler = make_scheduler(num_blocks=4000, max_num_batched_tokens=300, max_num_seqs=64)
    rng = random.Random(3)
    arrivals = iter(range(10**6))

    def arrive():
        index = next(arrivals)
        scheduler.add_request(make_request(f"d{index}", [1, 2], rng.randrange(10, 60)))

    for _ in range(45):
        arrive()
    advance(scheduler)
    image = make_item(256, "photo", bidirectional=True)
    scheduler.add_request(make_request("image", range(1, 264), 4, placed=[(3, image)]))
    computed = []
    for _ in range(200):
        arrive()
        arrive()
        advance(scheduler)
        request = scheduler.requests.get("image")
        computed.append(request.num_computed_tokens if request else 263)
    assert computed[0] == 3  # its text before the image went in the first step
    assert computed[-1] == 263  # the image, the rest of the prompt and its output followed


def test_prefix_cache_counts_each_request_once_despite_preemption():
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    scheduler = make_scheduler(num_blocks=10, max_num_seqs=8)
    requests = random_requests(2, 10, shared)
    for request in requests:
        scheduler.add_request(request)
    _, _, preempted, resumed = run_all(scheduler, FakeRunner())
    assert preempted and any(new.num_computed_tokens for new in resumed)  # resumes hit too
    kv = scheduler.kv_cache
    assert kv.num_query_tokens == sum(r.num_prompt_tokens for r in requests)
    assert kv.num_hit_tokens == sum(r.num_cached_tokens for r in requests) > 0


def test_a_recurrent_model_ends_chunks_on_blocks_and_hits_only_at_snapshots():
    cache = CacheConfig(block_size=BLOCK, held_share=0.0, mamba_snapshot_interval=2)
    config = SchedulerConfig(max_num_batched_tokens=10)
    scheduler = Scheduler(config, cache, num_blocks=64, num_state_snapshots=8)
    first = make_request("a", range(1, 23), max_tokens=1)  # 22 tokens
    scheduler.add_request(first)
    chunks, captures = [], []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        chunks.append(output.num_scheduled_tokens["a"])
        captures.append([c.num_tokens for c in output.state_captures.get("a", [])])
        scheduler.update_from_output(output, {"a": [7]})
    assert chunks == [8, 8, 6]  # a budget of 10 tokens: two blocks, two blocks, the rest
    # every second block (after tokens 8 and 16) and the prompt's last full block (20)
    assert captures == [[8], [8], [4]]
    # 14 shared tokens: K/V of three blocks is cached, the state only after the second
    second = make_request("b", [*range(1, 15), 60, 61, 62], max_tokens=1)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert second.num_cached_tokens == 8 and output.scheduled_new[0].restore_slot is not None
    assert scheduler.kv_cache.snapshots.num_restored == 1
    scheduler.update_from_output(output, {"b": [7]})
    scheduler.kv_cache.check_consistency()


def test_snapshots_wait_where_later_prompts_diverge():
    cache = CacheConfig(block_size=BLOCK, held_share=0.0, mamba_snapshot_interval=100)
    scheduler = Scheduler(SchedulerConfig(), cache, num_blocks=64, num_state_snapshots=16)
    shared = list(range(1, 31))

    def cached_tokens(request_id: str, token_ids: list[int]) -> int:
        request = make_request(request_id, token_ids, max_tokens=1)
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            scheduler.update_from_output(output, dict.fromkeys(output.num_scheduled_tokens, [7]))
        return request.num_cached_tokens

    assert cached_tokens("first", [*shared, 40, 41, 42]) == 0
    # the first's last two full blocks: another short ending hits at the first boundary
    assert cached_tokens("other ending", [*shared, 50, 51, 52]) == 28
    # 18 shared tokens: no snapshot there yet, but this one leaves one where it diverged
    assert cached_tokens("shorter", [*shared[:18], *range(60, 75)]) == 0
    assert cached_tokens("like it", [*shared[:18], *range(80, 95)]) == 16
    scheduler.kv_cache.check_consistency()


@pytest.mark.parametrize("cap", [None, 64])
def test_a_short_request_during_a_long_prefill_gets_its_first_token_within_two_chunks(cap):
    """With `max_prefill_tokens_per_request` a long prompt's chunks leave room in each step:
    a short request arriving mid-prefill runs its whole prefill in the next step, so its first
    token comes within two of the long prompt's chunk-steps (the step it arrived in, its own)."""
    scheduler = make_scheduler(
        num_blocks=512,
        max_num_batched_tokens=96,
        max_model_len=2048,
        max_prefill_tokens_per_request=cap,
    )
    runner, outputs = FakeRunner(), {}
    scheduler.add_request(make_request("long", [7] * 1500, max_tokens=2))
    chunks = [step(scheduler, runner, outputs).num_scheduled_tokens["long"] for _ in range(3)]
    scheduler.add_request(make_request("short", list(range(1, 23)), max_tokens=2))
    num_steps = 0
    while "short" not in outputs and num_steps < 100:
        step(scheduler, runner, outputs)
        num_steps += 1
    if cap is None:  # the long prompt takes every step's whole budget until it is done
        assert chunks == [96] * 3 and num_steps > 10
    else:
        assert chunks == [cap] * 3 and num_steps <= 2
        assert scheduler.requests["long"].num_computed_tokens < 1500  # still prefilling
    outputs, _, _, _ = run_all(scheduler, runner)
    assert_all_blocks_free(scheduler)


def test_a_bidirectional_item_larger_than_the_cap_still_runs_whole():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_prefill_tokens_per_request=4)
    item = make_item(12, "photo", bidirectional=True)
    scheduler.add_request(make_request("image", [5] * 16, placed=[(2, item)]))
    _, scheduled, _, _ = run_all(scheduler, FakeRunner())
    # up to the item, then the item in one piece (with the 2 tokens after it: the step had room)
    assert scheduled["image"][:2] == [2, 14]
    assert_all_blocks_free(scheduler)


def test_a_failed_step_gives_back_its_state_slots_and_saves_no_snapshot():
    """What a failed step computed is not trusted: its snapshot slots return unsaved, and once
    its requests are aborted every block is free; the same prompt then runs as if new."""
    cache = CacheConfig(block_size=BLOCK, held_share=0.0, mamba_snapshot_interval=2)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10), cache, 64, 8)
    snapshots = scheduler.kv_cache.snapshots
    scheduler.add_request(make_request("a", range(1, 23), max_tokens=1))
    output = scheduler.schedule()
    assert output.state_captures["a"] and snapshots.num_free_slots < 8
    assert scheduler.fail_step(output) == ["a"]
    assert scheduler.abort("a")
    assert snapshots.num_free_slots == 8 and not snapshots.saved_hashes()
    assert_all_blocks_free(scheduler)
    again = make_request("a2", range(1, 23), max_tokens=1)
    scheduler.add_request(again)
    scheduler.schedule()
    assert again.num_cached_tokens == 0  # nothing of the failed step is found
