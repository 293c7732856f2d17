"""LLMEngine: requests in, tokens and text out, many requests at once.

`step()` is schedule → run → postprocess, as in nano-vllm: the scheduler picks the tokens, the
runner computes them and samples, the scheduler applies the results, and the engine turns new
tokens into text (incremental detokenizer, stop strings) and per-request metrics. Prompts
arrive as token ids with their multimodal items already encoded (see `PromptProcessor` and
the vision pipeline): the engine never imports the vision side.

Live requests take input while they live (`append_input`): a held prefix (`hold=True`) grows by
prefill only; a `streaming` request generates in segments, and each stop (EOS, a stop token,
`max_tokens`) ends a segment (`RequestOutput.segment_end`) and waits for the next input.

A step whose forward or sampling raises fails the requests it ran, not the engine: they are
aborted (blocks, runner rows and state slots freed) and `StepFailed` names them; the next step
runs as usual. A broken invariant of the engine's own state (an `AssertionError`, an error in
scheduling) still propagates as it is.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike

import torch

from stillcut.engine.admission import BidirectionalItemTooLong
from stillcut.engine.arithmetic import Arithmetic, salted
from stillcut.engine.cache_groups import (
    kv_bytes_per_block,
    num_blocks_for_budget,
    num_snapshots_for_budget,
    recurrent_groups,
    state_bytes_per_request,
)
from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.config import EngineConfig, SchedulerConfig
from stillcut.engine.cuda_graphs import decode_buckets, graphs_unavailable
from stillcut.engine.detokenizer import IncrementalDetokenizer
from stillcut.engine.loader import checkpoint_dtype, resolve_checkpoint
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.outputs import RequestMetrics, RequestOutput, Snapshot
from stillcut.engine.processor import Prompt, PromptProcessor
from stillcut.engine.quantization import WeightFormat, stored_bytes
from stillcut.engine.request import (
    PlaceholderRange,
    Request,
    RequestStatus,
    SamplingParams,
    placeholder_ranges,
)
from stillcut.engine.runner import ModelRunner
from stillcut.engine.scheduler import Scheduler, max_num_live_requests
from stillcut.engine.scheduler_output import RequestUpdate, SchedulerOutput
from stillcut.engine.spec_decode.build import build_speculator
from stillcut.engine.spec_decode.draft import draft_block_bytes

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step's forward or sampling raised; `request_ids` are the requests it ran, now aborted.
    The cause is chained (`__cause__`); the engine goes on."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        super().__init__(f"a step failed; {len(request_ids)} request(s) in it were aborted")
        self.request_ids = tuple(request_ids)


@dataclass(frozen=True)
class EngineMemory:
    """What the engine holds: the weights' stored format and bytes (the language model's; int8
    scales included), the K/V pool's dtype, bytes and blocks."""

    weight_format: str
    weight_bytes: int
    kv_cache_dtype: str
    kv_cache_bytes: int
    kv_blocks: int
    arithmetic: Arithmetic

    def __str__(self) -> str:
        return (
            f"language model weights: {self.weight_format}, {self.weight_bytes / 2**20:.1f} MiB; "
            f"prefill and tower arithmetic: {self.arithmetic.name} ({self.arithmetic.reason}); "
            f"KV pool: {self.kv_cache_dtype}, {self.kv_blocks} blocks, "
            f"{self.kv_cache_bytes / 2**20:.1f} MiB"
        )


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list = field(default_factory=list)
    counting_append: bool = False  # its appended input is being prefilled


class LLMEngine:
    """One language model over a paged KV cache; `step()` advances every live request."""

    def __init__(self, model: str | PathLike, config: EngineConfig = EngineConfig()) -> None:
        self.path = resolve_checkpoint(model)
        self.config = config
        self.model_config = load_model_config(self.path)
        self.processor = PromptProcessor.from_checkpoint(self.path)
        family = self.model_config.family
        self.cache_groups = self.model_config.cache_groups
        model_class = family.language_model_class()
        self.weight_format = WeightFormat.for_engine(
            config.dtype,
            config.quantization,
            config.quantization_skip,
            config.device,
            config.compute_dtype,
        ).resolved(checkpoint_dtype(self.path, self.model_config))
        self.model = model_class.from_checkpoint(
            self.path, self.weight_format, device=config.device
        )
        if self.model.num_position_rows != family.num_position_rows:
            raise CheckpointError(
                f"family {family.model_type!r} declares {family.positions!r} positions, but "
                f"its language model takes {self.model.num_position_rows} position rows"
            )
        _check_item_budget(self.model.bidirectional_item_tokens, config.scheduler)
        self.block_size = config.cache.block_size
        num_rows = max_num_live_requests(config.scheduler)
        kv_dtype = self.weight_format.kv_cache_dtype(config.kv_cache_dtype)
        state_dtype = self.weight_format.compute_dtype  # recurrent states: what layers compute in
        cache = config.cache
        budget = cache.kv_cache_memory or int(cache.memory_fraction * _free_memory(config))
        budget = self._target_budget(budget, kv_dtype)
        num_snapshots = self._num_state_snapshots(budget, kv_dtype, state_dtype, num_rows)
        num_blocks = self._num_blocks(budget, kv_dtype, state_dtype, num_rows + num_snapshots)
        self.has_recurrent_state = bool(recurrent_groups(self.cache_groups))
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, num_snapshots)
        if num_snapshots:
            log.info(
                "%d recurrent-state snapshots of %d bytes each, one saved every %d KV blocks",
                num_snapshots,
                state_bytes_per_request(self.cache_groups, state_dtype.itemsize),
                config.cache.mamba_snapshot_interval,
            )
        no_graphs = graphs_unavailable(torch.device(config.device), self.has_recurrent_state)
        if config.enforce_eager:
            no_graphs = "enforce_eager is set"
        # a step decodes at most max_num_seqs running requests (rows may hold more, waiting),
        # each 1 + K one-token rows when it verifies drafts
        max_spec_tokens = config.speculative.num_speculative_tokens if config.speculative else 0
        max_decodes = min(config.scheduler.max_num_seqs, num_rows) * (1 + max_spec_tokens)
        buckets = (
            ()
            if no_graphs
            else decode_buckets(max_decodes, config.scheduler.max_num_batched_tokens)
        )
        self.runner = ModelRunner(
            self.model,
            self.cache_groups,
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_num_reqs=num_rows,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.scheduler.max_model_len,
            device=config.device,
            kv_dtype=kv_dtype,
            state_dtype=state_dtype,
            decode_buckets=buckets,
            num_state_snapshots=num_snapshots,
            max_spec_tokens=max_spec_tokens,
        )
        self.speculator = None
        if config.speculative is not None:
            self.speculator = build_speculator(self, config.speculative)
        self.memory = EngineMemory(
            self.weight_format.describe(),
            stored_bytes(self.model),
            str(kv_dtype).removeprefix("torch."),
            sum(cache.numel() * cache.element_size() for cache in self.runner.kv_caches),
            num_blocks,
            self.weight_format.arithmetic,
        )
        log.info("%s", self.memory)
        if no_graphs:
            log.info("decode steps run eagerly: %s", no_graphs)
        else:
            self.runner.capture_decode_graphs()
        self.eos_token_ids = self.processor.special.eos_token_ids
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        hold: bool = False,
        streaming: bool = False,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (admission errors raise here); returns its id.

        `prompt` is a `Prompt` from the processor, or token ids whose placeholder runs match
        `mm_items` in order. `hold=True` makes a prefill-only held prefix, `streaming=True` a
        request generating in segments; both take more input (see `append_input`).
        """
        if streaming and any(g.prompt_dependent for g in recurrent_groups(self.cache_groups)):
            raise ValueError(
                "streaming requests are not supported for this model: its recurrent layers "
                "compute prompt tokens otherwise than generated ones (held prefixes are)"
            )
        params = sampling_params or SamplingParams()
        if streaming and params.stop:
            raise ValueError(
                f"stop={params.stop!r}: a streaming request ends its segments at stop tokens "
                "(stop_token_ids), not at stop strings"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        token_ids, items, positions = self._placed(prompt, mm_items)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            mm_items=items,
            mm_positions=positions,
            sampling_params=params,
            cache_salt=salted(cache_salt, self.weight_format.arithmetic),
            eos_token_ids=self.eos_token_ids,
            hold=hold,
            streaming=streaming,
        )
        self.scheduler.add_request(request)
        detokenizer = IncrementalDetokenizer(
            self.processor.tokenizer, token_ids, stop=tuple(params.stop)
        )
        video = [item for item in items if item.kind == "video"]
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            num_prompt_tokens=len(token_ids),
            video_tokens_kept=sum(item.num_tokens for item in video),
            video_tokens_total=sum(item.num_dense_tokens for item in video),
        )
        self._tracked[request_id] = _Tracked(request, detokenizer, metrics)
        return request_id

    def append_input(
        self,
        request_id: str,
        new_input: Prompt | Sequence[int],
        mm_items: Sequence[MultiModalItem] = (),
    ) -> None:
        """Append input to a live request: a held prefix, or a streaming request waiting for
        input or generating (its output so far is kept and the new input follows it). As a
        prompt, `new_input` is a `Prompt` (placements relative to it) or token ids whose
        placeholder runs hold `mm_items`. Only the new tokens are prefilled; O(new tokens)."""
        ids, items, positions = self._placed(new_input, mm_items)
        self.scheduler.append_input(request_id, ids, items, positions)
        tracked = self._tracked[request_id]
        request, metrics = tracked.request, tracked.metrics
        metrics.num_prompt_tokens += len(ids)
        metrics.append_prefill_tokens.append(0)
        tracked.counting_append = True
        context = request.token_ids_between(max(request.num_tokens - 8, 0), request.num_tokens)
        tracked.detokenizer = IncrementalDetokenizer(self.processor.tokenizer, context)

    def release_held(self, request_id: str) -> None:
        """Free a held prefix; requests started from it keep the blocks they share."""
        self.scheduler.release_held(request_id)
        self._tracked.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks; False if it is unknown."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and self.speculator is not None:
            self.speculator.finish(tracked.request)
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns an output for every request that produced something."""
        scheduled = self.scheduler.schedule()
        now = time.monotonic()
        for new in scheduled.scheduled_new:
            tracked = self._tracked.get(new.request_id)
            if tracked is not None and tracked.metrics.first_scheduled_time is None:
                tracked.metrics.first_scheduled_time = now
                tracked.metrics.num_cached_tokens = tracked.request.num_cached_tokens
        for request_id, num_tokens in scheduled.num_scheduled_tokens.items():
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.counting_append:
                tracked.metrics.append_prefill_tokens[-1] += num_tokens
        try:
            result = self.runner.execute(scheduled)
        except AssertionError:
            raise  # the runner's own state is broken: nothing here can repair it
        except Exception as error:
            raise StepFailed(self._fail_step(scheduled)) from error
        updates = self.scheduler.update_from_output(scheduled, result.sampled)
        now = time.monotonic()
        outputs = []
        for update in updates:
            tracked = self._tracked.get(update.request_id)
            if tracked is None:
                continue
            tracked.counting_append = False  # its input is computed: it sampled or is held
            self._record_drafts(tracked, scheduled.spec_token_ids, result.sampled)
            logprobs = result.logprobs.get(update.request_id, [])
            outputs.append(self._postprocess(tracked, update, now, logprobs))
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _fail_step(self, scheduled: SchedulerOutput) -> list[str]:
        """Abort every request a failed step ran; their ids."""
        request_ids = self.scheduler.fail_step(scheduled)
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def _record_drafts(
        self, tracked: _Tracked, spec_token_ids: dict[str, list[int]], sampled: dict
    ) -> None:
        request_id = tracked.request.request_id
        drafts = spec_token_ids.get(request_id)
        if drafts and self.speculator is not None:
            self.speculator.record(tracked.request, len(drafts), len(sampled[request_id]))
            tracked.metrics.num_draft_tokens = tracked.request.num_draft_tokens
            tracked.metrics.num_accepted_tokens = tracked.request.num_accepted_tokens

    def generate(
        self,
        prompts: Sequence[Prompt | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion together; final outputs in prompt order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, sampling_params, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[i] for i in ids]

    def _postprocess(
        self, tracked: _Tracked, update: RequestUpdate, now: float, logprobs: list
    ) -> RequestOutput:
        request, metrics = tracked.request, tracked.metrics
        new_token_ids = update.new_token_ids
        if new_token_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
        delta = tracked.detokenizer.push(new_token_ids)
        finish_reason = None if update.segment_end else _finish_reason(update.status)
        stop_reason = update.stop_reason
        if tracked.detokenizer.finished and finish_reason not in ("stop", "held"):
            # a stop string completed: end the request here, whatever the tokens said; tokens
            # after it (accepted drafts, sampled in the same step) were never generated
            num_unread = tracked.detokenizer.num_unread_tokens
            if num_unread:
                del request.output_token_ids[-num_unread:]
                new_token_ids = new_token_ids[:-num_unread]
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            finish_reason, stop_reason = "stop", tracked.detokenizer.stop_reason
        elif finish_reason in ("stop", "length", "abort") or update.segment_end is not None:
            delta += tracked.detokenizer.flush()
        metrics.num_generated_tokens = len(request.output_token_ids)
        tracked.logprobs.extend(logprobs[: len(new_token_ids)])
        finished = finish_reason is not None
        if finished:
            metrics.finished_time = now
            if finish_reason != "held":
                self._tracked.pop(request.request_id, None)
                if self.speculator is not None:
                    self.speculator.finish(request)
        return RequestOutput(
            request_id=request.request_id,
            token_ids=Snapshot(request.output_token_ids),
            new_token_ids=new_token_ids,
            text_pieces=Snapshot(tracked.detokenizer.pieces),
            delta=delta,
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            metrics=metrics,
            logprobs=Snapshot(tracked.logprobs),
            segment_end=update.segment_end,
        )

    # ---- helpers -----------------------------------------------------------------------------

    def _placed(
        self, prompt: Prompt | Sequence[int], mm_items: Sequence[MultiModalItem]
    ) -> tuple[list[int], list[MultiModalItem], list[PlaceholderRange]]:
        """A request's (or appended input's) token ids, items and their placements; raises
        ValueError for an item without the feature sets the model consumes."""
        if isinstance(prompt, Prompt):
            token_ids, items = list(prompt.token_ids), list(prompt.items)
            positions = list(prompt.mm_positions)
        else:
            special = self.processor.special
            placeholders = (special.image_token_id, special.video_token_id)
            token_ids, items = [int(t) for t in prompt], list(mm_items)
            positions = placeholder_ranges(token_ids, items, placeholders)
        for item in items:
            item.check_features(self.model.mm_feature_names)
        return token_ids, items, positions

    def _target_budget(self, budget: int, kv_dtype: torch.dtype) -> int:
        """Our share of the K/V budget: all of it, or with a draft model (whose pool has as
        many blocks as ours) the part in proportion to our block bytes."""
        if self.config.speculative is None:
            return budget
        ours = kv_bytes_per_block(self.cache_groups, self.block_size, kv_dtype.itemsize)
        theirs = draft_block_bytes(self.config.speculative, self.block_size, kv_dtype.itemsize)
        return budget * ours // (ours + theirs)

    def _num_blocks(
        self, budget: int, kv_dtype: torch.dtype, state_dtype: torch.dtype, num_state_slots: int
    ) -> int:
        """KV blocks for the budget, after the recurrent states (one per runner row) and their
        snapshots, if any."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_blocks is not None:
            return cache.num_blocks
        # never more than every seat filled to max_model_len could use
        needed = 2 * sched.max_num_seqs * -(-sched.max_model_len // self.block_size)
        fitting = num_blocks_for_budget(
            budget,
            self.cache_groups,
            block_size=self.block_size,
            dtype_bytes=kv_dtype.itemsize,
            state_dtype_bytes=state_dtype.itemsize,
            num_state_slots=num_state_slots,
        )
        return min(fitting, needed)

    def _num_state_snapshots(
        self, budget: int, kv_dtype: torch.dtype, state_dtype: torch.dtype, num_rows: int
    ) -> int:
        """Recurrent-state snapshot slots (0 without recurrent layers): as configured, one per
        `mamba_snapshot_interval` configured blocks, or their share of the budget."""
        cache = self.config.cache
        if not state_bytes_per_request(self.cache_groups, state_dtype.itemsize):
            return 0
        if cache.num_state_snapshots is not None:
            return cache.num_state_snapshots
        if cache.num_blocks is not None:
            return max(1, cache.num_blocks // cache.mamba_snapshot_interval)
        return num_snapshots_for_budget(
            budget,
            self.cache_groups,
            block_size=self.block_size,
            dtype_bytes=kv_dtype.itemsize,
            state_dtype_bytes=state_dtype.itemsize,
            num_state_slots=num_rows,
            snapshot_interval=cache.mamba_snapshot_interval,
        )


def _check_item_budget(num_item_tokens: int, config: SchedulerConfig) -> None:
    """A bidirectional item is computed in one step, so the step budget must hold the largest."""
    if num_item_tokens > config.max_num_batched_tokens:
        raise BidirectionalItemTooLong(
            f"this model's images hold up to {num_item_tokens} tokens that attend to each other "
            f"both ways and cannot be split across prefill chunks, more than "
            f"max_num_batched_tokens={config.max_num_batched_tokens}; allowed: "
            f"max_num_batched_tokens >= {num_item_tokens}"
        )


def _free_memory(config: EngineConfig) -> int:
    if config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _finish_reason(status: RequestStatus) -> str | None:
    if status is RequestStatus.HELD:
        return "held"
    return status.value if status.is_finished else None
