"""The scheduler: which requests run each step, and how many tokens each computes.

As in vLLM v1 there are no prefill and decode phases: a step is a token budget shared by
requests, each given a number of new tokens. Running requests go first, decodes before prefill
chunks so admitting prompts never stalls generation; then waiting requests in FIFO order, each
first matched against the prefix cache. A prefill chunk is the rest of the prompt or of the
budget, whichever is smaller (and at most `max_prefill_tokens_per_request`, so a long prompt
shares every step with the others), but never ends inside a bidirectional item. When blocks run out
the newest running request is preempted: freed, and recomputed later, outputs included.
For a model with recurrent layers and prefix caching on, prefill chunks end on block boundaries
and each step says where the runner saves recurrent-state snapshots (`state_snapshots`).

Live requests take appended input: held prefixes (prefill-only, never preempted) and streaming
requests (a stop ends a segment, see `Request`). Between inputs a live request is HELD: it keeps
its blocks and its runner row, counts against `held_share` and `max_num_held_seqs` instead of
`max_num_seqs`, and is not scheduled. `append_input` puts it back among the running requests;
the runner gets only the appended part (`AppendedInput`), so an append costs O(new tokens).

Progress is guaranteed by a prefill reservation: while any running request goes without tokens
in a step (the budget is spent, its next chunk is a bidirectional item that does not fit what
the decodes left, or blocks are short), no waiting request is admitted. New requests would
become decodes scheduled ahead of it, so an image could wait forever behind arrivals; held
back, the requests ahead of it only finish, and an item always fits an empty step (admission
checks it against `max_num_batched_tokens`).

`schedule()`, the runner's step and `update_from_output()` strictly alternate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from stillcut.engine.admission import ResourceExhausted, check_held_share, check_request_size
from stillcut.engine.config import CacheConfig, SchedulerConfig
from stillcut.engine.kv_cache import NO_PREFIX, KVCacheManager
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.request import PlaceholderRange, Request, RequestStatus
from stillcut.engine.scheduler_output import (
    AppendedInput,
    CachedRequestData,
    NewRequestData,
    RequestUpdate,
    SchedulerOutput,
)
from stillcut.engine.state_snapshots import SnapshotPool


class Scheduler:
    """Owns the request queues and the KV cache manager.

    `num_blocks` overrides `cache_config.num_blocks` (the runner sizes the pool from memory);
    `num_state_snapshots` > 0 says the model has recurrent layers, and how many of their
    state snapshots the runner keeps.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int | None = None,
        num_state_snapshots: int = 0,
    ) -> None:
        num_blocks = cache_config.num_blocks if num_blocks is None else num_blocks
        if num_blocks is None or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1 (or set in cache_config)")
        self.config = config
        self.cache_config = cache_config
        snapshots = (
            SnapshotPool(num_state_snapshots, cache_config.mamba_snapshot_interval)
            if num_state_snapshots
            else None
        )
        self.kv_cache = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, snapshots
        )
        self.requests: dict[str, Request] = {}  # every unfinished request, held ones included
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they started running: last = newest
        self._finished_ids: list[str] = []  # rows the runner may drop, told at the next step
        self._appended: dict[str, list[AppendedInput]] = {}  # not yet told to the runner

    @property
    def _chunks_end_on_blocks(self) -> bool:
        """Prefill chunks of a model with recurrent layers end on block boundaries when
        prefix caching is on (a step budget smaller than a block leaves them unaligned)."""
        kv = self.kv_cache
        return (
            kv.snapshots is not None
            and kv.enable_prefix_caching
            and self.config.max_num_batched_tokens >= kv.block_size
        )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_held(self) -> int:
        return sum(r.status is RequestStatus.HELD for r in self.requests.values())

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work to do; held prefixes alone need none."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Admit a new request, or raise (`admission` errors) without changing anything."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        assert request.status is RequestStatus.WAITING and not request.block_ids, request
        max_tokens = _segment_tokens(request)
        self._check_size(request.num_prompt_tokens, max_tokens, request.mm_items, request.is_live)
        if request.is_live:
            num_live = sum(r.is_live for r in self.requests.values())
            if num_live >= self.config.max_num_held_seqs:
                raise ResourceExhausted(
                    f"{num_live} live requests (held prefixes, streaming requests) already; "
                    f"max_num_held_seqs={self.config.max_num_held_seqs}; end one or retry later"
                )
            self._check_held_share(_num_reserved_blocks(request, self.kv_cache.block_size))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def append_input(
        self,
        request_id: str,
        new_token_ids: Sequence[int],
        new_items: Sequence[MultiModalItem] = (),
        new_positions: Sequence[PlaceholderRange] = (),
    ) -> None:
        """Append tokens (and items placed in them, offsets relative to `new_token_ids`) to a
        live request after its tokens so far; only the new part (and a sampled token not yet
        computed) is prefilled, then a streaming request samples again. O(new tokens). Raises
        without changing anything when the input does not fit."""
        request = self._live(request_id)
        size = self.kv_cache.block_size
        num_tokens = request.num_tokens + len(new_token_ids)
        max_tokens = _segment_tokens(request)
        self._check_size(
            num_tokens,
            max_tokens,
            new_items,
            hold=True,
            num_earlier_visual_tokens=request.num_visual_tokens,
        )
        self._check_held_share(
            -(-(num_tokens + max_tokens) // size) - _num_reserved_blocks(request, size)
        )
        start = request.append_input(new_token_ids, new_items, new_positions)
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return  # no runner row yet: it enters with its whole sequence
        num_items = len(new_items)
        appended = AppendedInput(
            start,
            request.prompt_token_ids[start:],
            request.mm_items[len(request.mm_items) - num_items :],
            request.mm_positions[len(request.mm_positions) - num_items :],
        )
        self._appended.setdefault(request_id, []).append(appended)
        if request.status is RequestStatus.HELD:
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def release_held(self, request_id: str) -> None:
        """Free a HELD prefix; requests forked from it keep the blocks they share."""
        self._finish(self._held(request_id), RequestStatus.FINISHED_STOPPED)

    def abort(self, request_id: str) -> bool:
        """Drop a request in any state; False if it is unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """Finish a request from outside the step loop (a stop string the detokenizer matched,
        a client that left). False if it is unknown or already finished."""
        if not status.is_finished:
            raise ValueError(f"status={status} must be one of the FINISHED_* statuses")
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, status)
        return True

    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first, then waiting ones while budget, seats
        and blocks last."""
        output = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        # after a preemption blocks are short: admitting more would only preempt again; and a
        # running request left out this step has a reservation on the next (module docstring)
        if not output.preempted_ids and len(output.num_scheduled_tokens) == len(self.running):
            self._schedule_waiting(output, budget)
        return output

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[RequestUpdate]:
        """Apply a finished step: advance computed tokens, register full blocks, append the
        tokens sampled for requests whose prompt is now complete, and finish or hold them."""
        updates = []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens < request.num_tokens or request.hold:
                self.kv_cache.cache_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: its sampled token, if any, is meaningless
            if request.hold:
                self._hold(request)
                updates.append(RequestUpdate(request_id, [], RequestStatus.HELD))
                continue
            sampled = sampled_token_ids.get(request_id)
            assert sampled, f"no token sampled for {request_id!r}"
            new_token_ids, stop_status, stop_reason = self._accept_tokens(
                request, output.spec_token_ids.get(request_id, ()), sampled
            )
            segment_end = None
            if stop_status is not None and request.streaming:
                new_token_ids = self._end_segment(request, new_token_ids, stop_status, stop_reason)
                segment_end = stop_status.value
            elif stop_status is not None:
                self._finish(request, stop_status)
            updates.append(
                RequestUpdate(request_id, new_token_ids, request.status, stop_reason, segment_end)
            )
        for captures in output.state_captures.values():  # aborted requests' too: slots return
            self.kv_cache.commit_state_captures(captures)
        return updates

    def fail_step(self, output: SchedulerOutput) -> list[str]:
        """A step that raised: its state snapshots are given up (what it computed is not
        trusted) and the ids of the requests it ran are returned, for the caller to abort."""
        for captures in output.state_captures.values():
            for capture in captures:
                self.kv_cache.snapshots.commit(capture, block_cached=False)
        return [
            request_id for request_id in output.num_scheduled_tokens if request_id in self.requests
        ]

    def _accept_tokens(
        self, request: Request, drafts: Sequence[int], sampled: Sequence[int]
    ) -> tuple[list[int], RequestStatus | None, int | None]:
        """Append a step's sampled tokens and register the blocks they fill. A verify step
        computed K/V for every draft; those after the first rejected one are rolled back (their
        slots are overwritten later), and so are accepted ones past a stop."""
        num_accepted = min(len(sampled) - 1, len(drafts))
        request.num_computed_tokens -= len(drafts) - num_accepted
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += num_accepted
        appended = request.append_output(sampled)
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        # only now are the tokens in the request: a block is hashed once all of it is accepted
        self.kv_cache.cache_full_blocks(request)
        return appended

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        # decodes first: a long prefill chunk must not take the budget generation needs
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new == 0:
                continue
            drafts = self._drafts(request, num_new, budget)
            # room for the drafts only where blocks are free: never preempt for a guess
            new_block_ids = None
            if drafts:
                new_block_ids = self.kv_cache.allocate_slots(request, 1 + len(drafts))
            if new_block_ids is None:
                drafts = []
                new_block_ids = self._allocate_or_preempt(request, num_new, output)
            if new_block_ids is None:
                continue
            if drafts:
                output.spec_token_ids[request.request_id] = drafts
            output.num_scheduled_tokens[request.request_id] = num_new + len(drafts)
            appended = tuple(self._appended.pop(request.request_id, ()))
            output.scheduled_cached.append(
                CachedRequestData(
                    request.request_id, new_block_ids, request.num_computed_tokens, appended
                )
            )
            # a verify step saves states after its first token only: drafts may be rejected
            self._plan_state_captures(request, num_new, output)
            budget -= num_new + len(drafts)
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        # strict FIFO: when the head cannot start, nothing behind it overtakes it
        num_seated = sum(not r.is_live for r in self.running)  # live ones have rows of their own
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not request.is_live and num_seated >= self.config.max_num_seqs:
                break
            fresh = request.num_computed_tokens == 0  # new or preempted; not an extended prefix
            prefix = self.kv_cache.find_cached_prefix(request) if fresh else NO_PREFIX
            num_computed = request.num_computed_tokens + prefix.num_tokens
            num_new = self._num_new_tokens(request, num_computed, budget)
            if num_new == 0:
                break
            if self.kv_cache.allocate_slots(request, num_new, prefix) is None:
                break  # waiting requests never preempt running ones
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING and fresh:
                request.num_cached_tokens = prefix.num_tokens
            restore_slot = self.kv_cache.restored_state_slot(prefix)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_seated += not request.is_live
            output.num_scheduled_tokens[request.request_id] = num_new
            output.scheduled_new.append(NewRequestData.from_request(request, restore_slot))
            self._plan_state_captures(request, num_new, output)
            budget -= num_new

    def _plan_state_captures(self, request: Request, num_new: int, output: SchedulerOutput) -> None:
        captures = self.kv_cache.plan_state_captures(request, num_new)
        if captures:
            output.state_captures[request.request_id] = captures

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        cap = self.config.max_prefill_tokens_per_request
        if cap is not None and cap < budget:
            # a chunk the cap cuts to nothing (an item or a block larger than it) runs uncapped
            num_new = self._chunk(request, num_computed, cap)
            if num_new:
                return num_new
        return self._chunk(request, num_computed, budget)

    def _chunk(self, request: Request, num_computed: int, budget: int) -> int:
        """How many of the request's next tokens fit `budget`: all that are left, or a prefill
        chunk that ends where a chunk may end (0 if none)."""
        num_left = request.num_tokens - num_computed
        num_new = min(num_left, budget)
        if num_new < num_left and not self.config.enable_chunked_prefill:
            return 0
        if num_new < num_left and self._chunks_end_on_blocks:
            # the state at a chunk's end is then at a block boundary: a restart point
            size = self.kv_cache.block_size
            num_new = (num_computed + num_new) // size * size - num_computed
            if num_new <= 0:
                return 0
        num_new = request.chunk_end_at_or_before(num_computed + num_new) - num_computed
        assert num_new >= 0, "computed tokens never end inside a bidirectional item"
        return num_new

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The drafts to verify with a decode: as many of the proposed ones as the step budget,
        `max_tokens` and `max_model_len` leave room for (a verify step yields up to K + 1).
        None with more than one new token: a prompt chunk, or input appended to a live request
        (drafts guessed before it came would continue the tokens it follows)."""
        if num_new != 1 or not request.spec_token_ids or request.hold:
            return []
        params = request.sampling_params
        room = min(
            budget - 1,
            params.max_tokens - len(request.output_token_ids) - 1,
            self.config.max_model_len - request.num_tokens,
        )
        return list(request.spec_token_ids[: max(room, 0)])

    def _allocate_or_preempt(
        self, request: Request, num_new: int, output: SchedulerOutput
    ) -> list[int] | None:
        """Blocks for a running request, preempting the newest unscheduled requests (possibly
        this one) until they fit. None if the request cannot run this step."""
        while (new_block_ids := self.kv_cache.allocate_slots(request, num_new)) is None:
            victim = self._newest_preemptible(output)
            if victim is None:
                return None
            self._preempt(victim)
            output.preempted_ids.append(victim.request_id)
            if victim is request:
                return None
        return new_block_ids

    def _newest_preemptible(self, output: SchedulerOutput) -> Request | None:
        # what was scheduled this step stays: its tokens are already in the output
        for request in reversed(self.running):
            if not request.hold and request.request_id not in output.num_scheduled_tokens:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        self._appended.pop(request.request_id, None)  # it re-enters with its whole sequence
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        # to the front: preempted requests resume before new ones, oldest victim first
        self.waiting.appendleft(request)

    def _end_segment(
        self,
        request: Request,
        new_token_ids: list[int],
        stop_status: RequestStatus,
        stop_reason: int | None,
    ) -> list[int]:
        """A streaming request's segment stopped: it waits for input. An EOS that ended it is
        not kept (the next input follows the segment's text). Returns the tokens kept."""
        if stop_status is RequestStatus.FINISHED_STOPPED and stop_reason is None:  # EOS
            request.output_token_ids.pop()
            new_token_ids = new_token_ids[:-1]
        self._hold(request)
        return new_token_ids

    def _hold(self, request: Request) -> None:
        """A live request waits for input: it keeps its blocks and its runner row."""
        self.running.remove(request)
        request.status = RequestStatus.HELD

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._appended.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def _held(self, request_id: str) -> Request:
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.HELD:
            state = "unknown" if request is None else request.status.value
            raise ValueError(f"request {request_id!r} is {state}; only a held prefix qualifies")
        return request

    def _live(self, request_id: str) -> Request:
        request = self.requests.get(request_id)
        if request is None or not request.is_live:
            state = "unknown" if request is None else "not live (neither hold nor streaming)"
            raise ValueError(
                f"request {request_id!r} is {state}; input is appended only to a held prefix "
                "or a streaming request"
            )
        return request

    def _check_size(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        items: Sequence[MultiModalItem],
        hold: bool,
        num_earlier_visual_tokens: int = 0,
    ) -> None:
        check_request_size(
            num_prompt_tokens,
            max_tokens,
            items,
            self.config,
            num_blocks=self.kv_cache.num_blocks,
            block_size=self.kv_cache.block_size,
            held_share=self.cache_config.held_share,
            hold=hold,
            num_earlier_visual_tokens=num_earlier_visual_tokens,
        )

    def _check_held_share(self, num_new_blocks: int) -> None:
        # every live request counts for its whole prompt and segment, even before it is computed
        size = self.kv_cache.block_size
        num_held_blocks = sum(
            _num_reserved_blocks(r, size) for r in self.requests.values() if r.is_live
        )
        check_held_share(
            num_held_blocks,
            num_new_blocks,
            num_blocks=self.kv_cache.num_blocks,
            held_share=self.cache_config.held_share,
        )


def _segment_tokens(request: Request) -> int:
    """Tokens a request may still generate after its prompt: 0 for a prefill-only one."""
    return 0 if request.hold else request.sampling_params.max_tokens


def _num_reserved_blocks(request: Request, block_size: int) -> int:
    """Blocks a live request pins: its prompt and a whole segment after it."""
    return -(-(request.num_prompt_tokens + _segment_tokens(request)) // block_size)


def max_num_live_requests(config: SchedulerConfig) -> int:
    """How many requests can hold a runner row at once: the running ordinary ones and every
    live one (held prefixes and streaming requests keep their rows while they wait); rows of
    finished and preempted requests are dropped before new ones are added."""
    return config.max_num_seqs + config.max_num_held_seqs
