"""Sampling for the runner's requests, kept from step to step.

What a request samples with never changes while it lives: its parameters and, when seeded, its
own generator, which outlives preemption so a resumed request keeps drawing where it was (with
speculative decoding, a generator per output position instead: `keyed_draws`). After a verify
step a request's positions are sampled in order, each as if alone, while drafts are accepted
(`Sampler`'s rejection step), so penalties and filters see exactly the tokens before them. So
the batch of sampling parameters is built once and reused while the same requests sample in
the same order (a run of decode steps). A penalized request carries `TokenCounts`, built from
its history at its first sample and grown by one token per step, so no step reads a whole
history. Both live until the request finishes (`forget`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stillcut.engine.request import SamplingParams
from stillcut.engine.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingBatch,
    TokenCounts,
    first_argmax_ids,
)
from stillcut.engine.sampler import build_sampling_batch as _build

# request index in the step -> (prompt ids, output ids so far), read once per penalized request
History = Callable[[int], tuple[Sequence[int] | torch.Tensor, Sequence[int]]]


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens (one per sampling request, up to K + 1 after a verify step) and, when
    asked for, their logprobs (one entry per sampled token)."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[tuple[list[int], list[float], float]]]


class RowSampler:
    """Samples each request's tokens from its logits rows; see the module docstring.

    With `keyed_draws` (speculative decoding), a seeded request's draws for output token i come
    from a generator seeded by (seed, i), so its tokens do not depend on which step, batch or
    draft window produced them; otherwise from one generator per request, drawn in turn.
    """

    def __init__(self, device: torch.device, keyed_draws: bool = False) -> None:
        self.device = device
        self.keyed_draws = keyed_draws
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self._token_counts: dict[str, TokenCounts] = {}
        self._last: tuple[tuple[str, ...], SamplingBatch] | None = None

    def admit(self, request_id: str, params: SamplingParams) -> None:
        """A request enters the runner (new, or resumed: then it keeps its generator)."""
        if params.seed is not None and request_id not in self.generators:
            self.generators[request_id] = torch.Generator(self.device).manual_seed(params.seed)

    def forget(self, request_id: str) -> None:
        """A request finished: its generator and counts go, and its id may come back new."""
        self.generators.pop(request_id, None)
        self._token_counts.pop(request_id, None)
        self._last = None

    def sample(
        self,
        request_ids: list[str],
        params: list[SamplingParams],
        history: History,
        logits: torch.Tensor,
        drafts: Sequence[Sequence[int]] | None = None,
        num_outputs: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], StepResult]:
        """Each request's tokens from `logits` [sum of (1 + its drafts), vocab]: request r's
        rows are the positions of its last token and its drafts `drafts[r]` (none by default).
        Position i is sampled given the tokens before it, as if one at a time: while the token
        at i accepts draft i, position i + 1 is sampled too. `num_outputs[r]` (with keyed draws)
        counts the output tokens request r had before this step."""
        if drafts is None or not any(drafts):
            batch = self._batch(request_ids, params, history, logits.shape[1])
            if batch.all_greedy and batch.num_logprobs is None and batch.output_counts is None:
                # each row's argmax, nothing else asked: the sampler's greedy path, without it
                tokens = [[token_id] for token_id in first_argmax_ids(logits)]
                return tokens, StepResult(dict(zip(request_ids, tokens, strict=True)), {})
        drafts = drafts if drafts is not None else [()] * len(request_ids)
        first_rows = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        tokens: list[list[int]] = [[] for _ in request_ids]
        logprobs: dict[str, list] = {}
        live = list(range(len(request_ids)))
        for i in range(max(map(len, drafts)) + 1):
            ids, live_params = [request_ids[r] for r in live], [params[r] for r in live]
            batch = self._batch(
                ids, live_params, lambda j, live=live: history(live[j]), logits.shape[1]
            )
            if self.keyed_draws and num_outputs is not None:
                batch = _keyed(batch, live_params, [num_outputs[r] + i for r in live])
            draft_ids = [drafts[r][i] if i < len(drafts[r]) else -1 for r in live]
            # without drafts every row samples once, in order: no gather of the logits
            rows = (
                logits
                if len(live) == logits.shape[0]
                else logits[[first_rows[r] + i for r in live]]
            )
            output = self.sampler(
                rows,
                batch,
                None if max(draft_ids) < 0 else torch.tensor(draft_ids, device=self.device),
            )
            step_logprobs = _logprobs_by_request(ids, live_params, output.logprobs)
            for j, token_id in enumerate(output.token_ids.tolist()):
                r = live[j]
                tokens[r].append(token_id)
                counts = self._token_counts.get(request_ids[r])
                if counts is not None:
                    counts.add(token_id)
                if request_ids[r] in step_logprobs:
                    logprobs.setdefault(request_ids[r], []).append(step_logprobs[request_ids[r]])
            live = [r for r, d in zip(live, draft_ids, strict=True) if tokens[r][-1] == d >= 0]
            if not live:
                break
        sampled = dict(zip(request_ids, tokens, strict=True))
        return tokens, StepResult(sampled, logprobs)

    def _batch(
        self,
        request_ids: list[str],
        params: list[SamplingParams],
        history: History,
        vocab_size: int,
    ) -> SamplingBatch:
        """Last step's batch while the same requests sample and none is penalized (their
        counts change every step; nothing else does), else a new one."""
        key = tuple(request_ids)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        for index, (request_id, request_params) in enumerate(zip(key, params, strict=True)):
            if request_id not in self._token_counts and TokenCounts.needed(request_params):
                prompt_ids, output_ids = history(index)
                self._token_counts[request_id] = TokenCounts(
                    prompt_ids, output_ids, vocab_size, self.device
                )
        batch = _build(
            params,
            [self._token_counts.get(r) for r in key],
            [self.generators.get(r) for r in key],
            self.device,
        )
        self._last = (key, batch) if batch.output_counts is None else None
        return batch


def _keyed(
    batch: SamplingBatch, params: list[SamplingParams], positions: list[int]
) -> SamplingBatch:
    """`batch` with each seeded random row drawing from a generator of (seed, position)."""
    generators = tuple(
        None if g is None else keyed_generator(p.seed, position, g.device)
        for g, p, position in zip(batch.generators, params, positions, strict=True)
    )
    return dataclasses.replace(batch, generators=generators)


def keyed_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A generator for draws at one output position of a seeded request (splitmix64 of both)."""
    mixed = (seed + (position + 1) * 0x9E3779B97F4A7C15) % 2**64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) % 2**64
    return torch.Generator(device).manual_seed(mixed ^ (mixed >> 31))


def _logprobs_by_request(
    request_ids: list[str], params: list[SamplingParams], logprobs: LogprobsTensors | None
) -> dict[str, tuple[list[int], list[float], float]]:
    if logprobs is None:
        return {}
    result = {}
    for i, (request_id, request_params) in enumerate(zip(request_ids, params, strict=True)):
        n = request_params.logprobs
        if n is None:
            continue
        result[request_id] = (
            logprobs.top_token_ids[i, :n].tolist(),
            logprobs.top_logprobs[i, :n].tolist(),
            float(logprobs.sampled_logprobs[i]),
        )
    return result
