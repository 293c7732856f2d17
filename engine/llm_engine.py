"""LLMEngine: requests in, tokens and text out, many requests at once.

`step()` is schedule → run → postprocess, as in nano-vllm: the scheduler picks the tokens, the
runner computes them and samples, the scheduler applies the results, and the output processor
(`output_processor`) turns new tokens into text (incremental detokenizer, stop strings) and
per-request metrics. How memory is split between K/V blocks, recurrent-state snapshots and
decode graphs is `memory_plan`'s. Prompts
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
import time
from collections.abc import Sequence

import torch

from stillcut.engine.admission import BidirectionalItemTooLong
from stillcut.engine.arithmetic import salted
from stillcut.engine.cache_groups import recurrent_groups, state_bytes_per_request
from stillcut.engine.checkpoint import CheckpointLike, open_checkpoint
from stillcut.engine.config import EngineConfig, SchedulerConfig
from stillcut.engine.loader import checkpoint_dtype
from stillcut.engine.memory_plan import EngineMemory, plan_memory
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.output_processor import OutputProcessor, TrackedRequest
from stillcut.engine.outputs import RequestOutput
from stillcut.engine.processor import Prompt, PromptProcessor
from stillcut.engine.quantization import WeightFormat, stored_bytes
from stillcut.engine.request import (
    PlaceholderRange,
    Request,
    SamplingParams,
    placeholder_ranges,
)
from stillcut.engine.runner import ModelRunner
from stillcut.engine.scheduler import Scheduler, max_num_live_requests
from stillcut.engine.scheduler_output import SchedulerOutput
from stillcut.engine.spec_decode.build import build_speculator

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step's forward or sampling raised; `request_ids` are the requests it ran, now aborted.
    The cause is chained (`__cause__`); the engine goes on."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        super().__init__(f"a step failed; {len(request_ids)} request(s) in it were aborted")
        self.request_ids = tuple(request_ids)


class LLMEngine:
    """One language model over a paged KV cache; `step()` advances every live request."""

    def __init__(self, model: CheckpointLike, config: EngineConfig = EngineConfig()) -> None:
        self.checkpoint = open_checkpoint(model)
        self.path = self.checkpoint.folder
        self.config = config
        self.model_config = self.checkpoint.config
        self.processor = PromptProcessor.from_checkpoint(self.checkpoint)
        self.cache_groups = self.model_config.cache_groups
        self.weight_format = WeightFormat.for_engine(
            config.dtype,
            config.quantization,
            config.quantization_skip,
            config.device,
            config.compute_dtype,
        ).resolved(checkpoint_dtype(self.checkpoint))
        self.model = self._load_model()
        self.block_size = config.cache.block_size
        num_rows = max_num_live_requests(config.scheduler)
        kv_dtype = self.weight_format.kv_cache_dtype(config.kv_cache_dtype)
        state_dtype = self.weight_format.compute_dtype  # recurrent states: what layers compute in
        plan = plan_memory(config, self.cache_groups, kv_dtype, state_dtype, num_rows)
        self.has_recurrent_state = bool(recurrent_groups(self.cache_groups))
        self.scheduler = Scheduler(
            config.scheduler, config.cache, plan.num_blocks, plan.num_snapshots
        )
        if plan.num_snapshots:
            log.info(
                "%d recurrent-state snapshots of %d bytes each, one saved every %d KV blocks",
                plan.num_snapshots,
                state_bytes_per_request(self.cache_groups, state_dtype.itemsize),
                config.cache.mamba_snapshot_interval,
            )
        self.runner = ModelRunner(
            self.model,
            self.cache_groups,
            num_blocks=plan.num_blocks,
            block_size=self.block_size,
            max_num_reqs=num_rows,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.scheduler.max_model_len,
            device=config.device,
            kv_dtype=kv_dtype,
            state_dtype=state_dtype,
            decode_buckets=plan.decode_buckets,
            num_state_snapshots=plan.num_snapshots,
            max_spec_tokens=plan.max_spec_tokens,
        )
        self.speculator = None
        if config.speculative is not None:
            self.speculator = build_speculator(self, config.speculative)
        self.memory = EngineMemory(
            self.weight_format.describe(),
            stored_bytes(self.model),
            str(kv_dtype).removeprefix("torch."),
            sum(cache.numel() * cache.element_size() for cache in self.runner.kv_caches),
            plan.num_blocks,
            self.weight_format.arithmetic,
        )
        log.info("%s", self.memory)
        if plan.no_graphs:
            log.info("decode steps run eagerly: %s", plan.no_graphs)
        else:
            self.runner.capture_decode_graphs()
        self.eos_token_ids = self.processor.special.eos_token_ids
        self.outputs = OutputProcessor(self.processor.tokenizer, self.scheduler.finish_request)
        self._ids = itertools.count()

    def _load_model(self) -> torch.nn.Module:
        """The family's language model in `weight_format`, checked against the entry."""
        family = self.model_config.family
        model = family.language_model_class().from_checkpoint(
            self.checkpoint, self.weight_format, device=self.config.device
        )
        if model.num_position_rows != family.num_position_rows:
            raise CheckpointError(
                f"family {family.model_type!r} declares {family.positions!r} positions, but "
                f"its language model takes {model.num_position_rows} position rows"
            )
        _check_item_budget(model.bidirectional_item_tokens, self.config.scheduler)
        return model

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
        self.outputs.track(request, params.stop)
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
        self.outputs.track_append(request_id, len(ids))

    def release_held(self, request_id: str) -> None:
        """Free a held prefix; requests started from it keep the blocks they share."""
        self.scheduler.release_held(request_id)
        self.outputs.tracked.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks; False if it is unknown."""
        tracked = self.outputs.tracked.pop(request_id, None)
        if tracked is not None and self.speculator is not None:
            self.speculator.finish(tracked.request)
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns an output for every request that produced something."""
        scheduled = self.scheduler.schedule()
        self.outputs.record_schedule(scheduled, time.monotonic())
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
            tracked = self.outputs.tracked.get(update.request_id)
            if tracked is None:
                continue
            tracked.counting_append = False  # its input is computed: it sampled or is held
            self._record_drafts(tracked, scheduled.spec_token_ids, result.sampled)
            logprobs = result.logprobs.get(update.request_id, [])
            output = self.outputs.process(tracked, update, now, logprobs)
            if output.finish_reason not in (None, "held") and self.speculator is not None:
                self.speculator.finish(tracked.request)
            outputs.append(output)
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
        self, tracked: TrackedRequest, spec_token_ids: dict[str, list[int]], sampled: dict
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


def _check_item_budget(num_item_tokens: int, config: SchedulerConfig) -> None:
    """A bidirectional item is computed in one step, so the step budget must hold the largest."""
    if num_item_tokens > config.max_num_batched_tokens:
        raise BidirectionalItemTooLong(
            f"this model's images hold up to {num_item_tokens} tokens that attend to each other "
            f"both ways and cannot be split across prefill chunks, more than "
            f"max_num_batched_tokens={config.max_num_batched_tokens}; allowed: "
            f"max_num_batched_tokens >= {num_item_tokens}"
        )
