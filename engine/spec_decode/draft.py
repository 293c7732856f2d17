"""Draft-model proposals: a smaller checkpoint of a registered family, with the target's
tokenizer, vocabulary and preprocessing, proposes K tokens greedily.

The draft keeps its own `ModelRunner` (its own K/V cache, its own shapes) and block manager,
with one mirror request per target request. Per proposal round a mirror first catches up: the
tokens the target has that its K/V does not hold (the prompt at first; later the target's
accepted drafts and its correction, from the first token where they differ, so a rejected draft
is rolled back by overwriting) are computed in one step that samples the first draft; then
K - 1 one-token steps sample the rest, all mirrors batched. Memory: the draft's pool has as many
blocks as the target's, and when the target's pool is sized from a memory budget the two split
it in proportion to their bytes per block (`memory_plan`), so both hold the same
number of tokens.

Images and video: the draft sees what the target sees. The vision pipeline built with the
engine's draft (`VisionPipeline(draft_model=...)`) runs the draft's own tower on the same
preprocessed frames and keeps exactly the tokens the target's EVS kept, so each item carries
the draft's embeddings among its features (`DRAFT`); a mirror holds copies of the target's
items whose `embeds` (and features) are the draft's (`for_draft`), at the target's placements,
and the draft model places them with its own position math. A request
with an item lacking draft embeddings of the draft's width (encoded without the draft, e.g.
items a Python caller encoded with another pipeline) gets no drafts. A mirror keeps the target's
output as output, so its positions are the ones the target's runner gave it.

Input appended to a live request (streaming input, narration): the mirror takes it as the
target's runner did, O(new tokens): the tokens before the first new item become its output
(output the target kept, text), and the rest of the new prompt goes into its row as appended
input, with the new items (the draft's copies), before it catches up. The mirror does not see
where the target's input began, nor output between two appends it takes at once, so such text
is placed as output (or as prompt) would be; its positions differ from the target's only where
the sequence before it ended with a video whose positions run past its text (never after
one-tubelet narration items), which costs acceptance, never exactness.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from stillcut.engine.cache_groups import kv_bytes_per_block, recurrent_groups
from stillcut.engine.checkpoint import open_checkpoint
from stillcut.engine.config import SpeculativeConfig
from stillcut.engine.kv_cache import KVCacheManager
from stillcut.engine.loader import checkpoint_dtype
from stillcut.engine.multimodal import DRAFT
from stillcut.engine.quantization import WeightFormat
from stillcut.engine.request import PlaceholderRange, Request, SamplingParams
from stillcut.engine.runner import ModelRunner
from stillcut.engine.scheduler_output import (
    AppendedInput,
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

GREEDY = SamplingParams(temperature=0.0)
# the files and vision fields that decide how media become tokens: they must be the target's
PREPROCESSING_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")
PATCH_FIELDS = (
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "in_channels",
    "mm_tokens_per_image",
)


class DraftMismatch(ValueError):
    """The draft checkpoint cannot propose for this target."""


def draft_block_bytes(config: SpeculativeConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one K/V block of the draft model (0 without one)."""
    if config.method != "draft":
        return 0
    groups = open_checkpoint(config.draft_model).config.cache_groups
    return kv_bytes_per_block(groups, block_size, dtype_bytes)


class DraftProposer:
    """Greedy drafts from a smaller model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        runner: ModelRunner,
        num_blocks: int,
        block_size: int,
        hidden_size: int,
    ):
        self.model = model
        self.runner = runner
        self.hidden_size = hidden_size  # the width of the item embeddings it places
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.mirrors: dict[str, Request] = {}
        self._finished: list[str] = []  # rows the draft runner drops at its next step

    @classmethod
    def for_target(cls, engine, config: SpeculativeConfig) -> DraftProposer:
        """Load and check the draft for `engine`'s target; raises `DraftMismatch`."""
        checkpoint = open_checkpoint(config.draft_model)
        path, draft_config = checkpoint.folder, checkpoint.config
        check_draft(engine.path, engine.model_config, path, draft_config)
        family = draft_config.family
        target = engine.config
        # the target's precision settings, resolved for the draft's own checkpoint
        weight_format = WeightFormat.for_engine(
            target.dtype, target.quantization, target.quantization_skip, target.device
        ).resolved(checkpoint_dtype(checkpoint))
        model = family.language_model_class().from_checkpoint(
            checkpoint, weight_format, device=target.device
        )
        if _num_parameters(model) > _num_parameters(engine.model):
            raise DraftMismatch(
                f"draft {path} has {_num_parameters(model)} parameters, the target "
                f"{_num_parameters(engine.model)}; allowed: a draft no larger than the target"
            )
        scheduler = engine.config.scheduler
        num_blocks = engine.runner.kv_caches[0].shape[1]
        runner = ModelRunner(
            model,
            draft_config.cache_groups,
            num_blocks=num_blocks,
            block_size=engine.block_size,
            max_num_reqs=engine.runner.block_table.shape[0],
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_model_len=scheduler.max_model_len,
            device=target.device,
            kv_dtype=engine.runner.kv_caches[0].dtype,
            state_dtype=weight_format.compute_dtype,
        )
        return cls(model, runner, num_blocks, engine.block_size, draft_config.text["hidden_size"])

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {}
        active = []
        for request, k in zip(requests, num_tokens, strict=True):
            if not self._sees_items(request):
                self.finish(request)  # an item the draft cannot see was appended: no drafts
            elif k:
                active.append((request, k))
        step = self._catch_up([r for r, _ in active])
        for i in range(max((k for _, k in active), default=0)):
            if i:
                step = self._decode_step([r for r, k in active if k > i and r.request_id in drafts])
            sampled = self.runner.execute(step).sampled
            for request_id, (token_id,) in sampled.items():
                drafts.setdefault(request_id, []).append(token_id)
                self.mirrors[request_id].output_token_ids.append(token_id)
            self._advance(step)
        return [drafts.get(r.request_id, []) for r in requests]

    def finish(self, request: Request) -> None:
        mirror = self.mirrors.pop(request.request_id, None)
        if mirror is not None:
            self.kv_cache.free(mirror)
            self._finished.append(request.request_id)

    def _sees_items(self, request: Request) -> bool:
        """Whether every item of `request` carries the draft's embeddings (of its width) and
        the draft tower's feature sets the draft model consumes."""
        consumed = [f"{DRAFT}/{name}" for name in self.runner.feature_names]
        return all(
            DRAFT in item.features
            and item.features[DRAFT].shape[1] == self.hidden_size
            and all(name in item.features for name in consumed)
            for item in request.mm_items
        )

    # ---- steps -------------------------------------------------------------------------------

    def _catch_up(self, requests: Sequence[Request]) -> SchedulerOutput:
        """One step computing, for each request, the tokens its mirror lacks (within the step
        budget); samples the first draft."""
        output, budget = self._output(), self.runner.max_num_batched_tokens
        for request in requests:
            if budget == 0:
                break  # the rest catch up in a later round
            budget -= self._schedule_mirror(request, budget, output)
        return output

    def _schedule_mirror(self, request: Request, budget: int, output: SchedulerOutput) -> int:
        """Schedule into `output` the tokens `request`'s mirror lacks, at most `budget` and
        never ending inside a bidirectional item; returns how many. The mirror is made at
        first, then kept in step with the target (`_sync`); one that gets no blocks is dropped
        (that request gets no drafts). A mirror that cannot catch up in one step samples
        nothing until it has."""
        tokens = request.all_token_ids
        mirror = self.mirrors.get(request.request_id)
        is_new = mirror is None
        if is_new:
            mirror, num_valid = _mirror(request), 0
        else:
            num_valid = self._sync(request, mirror, tokens)
        num_new = mirror.chunk_end_at_or_before(min(len(tokens), num_valid + budget)) - num_valid
        if num_new <= 0:
            return 0
        new_block_ids = self.kv_cache.allocate_slots(mirror, num_new)
        if new_block_ids is None:
            self.finish(request)
            return 0
        if is_new:
            self.mirrors[request.request_id] = mirror
            output.scheduled_new.append(NewRequestData.from_request(mirror))
        else:
            cached = CachedRequestData(request.request_id, new_block_ids, num_valid)
            output.scheduled_cached.append(cached)
        output.num_scheduled_tokens[request.request_id] = num_new
        return num_new

    def _sync(self, request: Request, mirror: Request, tokens: list[int]) -> int:
        """Make `mirror`'s tokens the target's `tokens` (its row too), taking input appended
        to the target since; returns how many of its computed tokens stay valid (the rest,
        drafts the target rejected, are overwritten when computed again)."""
        num_valid = _common_prefix(mirror.all_token_ids[: mirror.num_computed_tokens], tokens)
        if len(request.mm_items) > len(mirror.mm_items):
            num_valid = self._append_items(request, mirror, tokens, num_valid)
        mirror.output_token_ids[:] = tokens[mirror.num_prompt_tokens :]
        mirror.num_computed_tokens = num_valid
        self.runner.rewrite_tokens(request.request_id, num_valid, tokens[num_valid:])
        return num_valid

    def _append_items(
        self, request: Request, mirror: Request, tokens: list[int], num_valid: int
    ) -> int:
        """Give `mirror` the input appended to `request` since it last caught up: the tokens
        before the first new item become its output, the rest of the prompt and the new items
        (the draft's copies) go into its row now (a step that runs no tokens), so that output
        after them can be written into the row. Returns how many of its tokens stay valid."""
        first = len(mirror.mm_items)
        start = request.mm_positions[first].offset
        num_valid = min(num_valid, start)
        mirror.output_token_ids[:] = tokens[mirror.num_prompt_tokens : start]
        self.runner.rewrite_tokens(request.request_id, num_valid, tokens[num_valid:start])
        new_ids = tokens[start : request.num_prompt_tokens]
        items = [item.for_draft() for item in request.mm_items[first:]]
        offsets = [
            PlaceholderRange(p.offset - start, p.length) for p in request.mm_positions[first:]
        ]
        mirror.append_input(new_ids, items, offsets)
        appended = AppendedInput(start, new_ids, items, mirror.mm_positions[first:])
        cached = CachedRequestData(request.request_id, [], num_valid, (appended,))
        self.runner.execute(SchedulerOutput(scheduled_cached=[cached]))
        return num_valid

    def _decode_step(self, requests: Sequence[Request]) -> SchedulerOutput:
        """One token each: the draft each mirror sampled last."""
        output = self._output()
        for request in requests:
            mirror = self.mirrors[request.request_id]
            new_block_ids = self.kv_cache.allocate_slots(mirror, 1)
            if new_block_ids is None:
                continue  # out of blocks: this request's drafts end here
            output.scheduled_cached.append(
                CachedRequestData(request.request_id, new_block_ids, mirror.num_computed_tokens)
            )
            output.num_scheduled_tokens[request.request_id] = 1
        return output

    def _output(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_ids=self._finished)
        self._finished = []
        return output

    def _advance(self, step: SchedulerOutput) -> None:
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            self.mirrors[request_id].num_computed_tokens += num_tokens


def check_draft(target_path: Path, target_config, draft_path: Path, draft_config) -> None:
    """Refuse a draft whose tokenizer, vocabulary or preprocessing differs from the target's,
    or whose family has recurrent layers (its state could not be rolled back)."""
    where = f"draft {draft_path} for target {target_path}"
    if _file_text(target_path, "tokenizer.json") != _file_text(draft_path, "tokenizer.json"):
        raise DraftMismatch(f"{where}: the tokenizers differ; allowed: the target's tokenizer")
    target_vocab, draft_vocab = _vocab_size(target_path), _vocab_size(draft_path)
    if target_vocab != draft_vocab:
        raise DraftMismatch(
            f"{where}: vocab_size {draft_vocab} != the target's {target_vocab}; allowed: equal"
        )
    for name in PREPROCESSING_FILES:
        if _file_json(target_path, name) != _file_json(draft_path, name):
            raise DraftMismatch(f"{where}: {name} differs; allowed: the target's preprocessing")
    for name in PATCH_FIELDS:
        ours, theirs = (
            getattr(target_config.vision, name, None),
            getattr(draft_config.vision, name, None),
        )
        if ours != theirs:
            raise DraftMismatch(
                f"{where}: vision {name}={theirs}, the target's is {ours}; allowed: equal"
            )
    if recurrent_groups(draft_config.cache_groups):
        raise DraftMismatch(f"{where}: the draft has recurrent layers; allowed: attention only")


def _mirror(request: Request) -> Request:
    """A greedy copy of `request` whose items carry the draft's embeddings; its output stays
    output, placed after the prompt as the target's runner placed it."""
    items = [item.for_draft() for item in request.mm_items]
    mirror = Request(
        request.request_id,
        request.prompt_token_ids,
        mm_items=items,
        mm_positions=request.mm_positions,
        sampling_params=GREEDY,
    )
    mirror.output_token_ids = list(request.output_token_ids)
    return mirror


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def _num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _file_text(folder: Path, name: str) -> str | None:
    path = Path(folder) / name
    return path.read_text() if path.is_file() else None


def _file_json(folder: Path, name: str):
    text = _file_text(folder, name)
    return None if text is None else json.loads(text)


def _vocab_size(folder: Path) -> int | None:
    config = json.loads((Path(folder) / "config.json").read_text())
    text = config.get("text_config", config)
    return text.get("vocab_size", config.get("vocab_size"))
