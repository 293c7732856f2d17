"""Sampling for the runner's requests, kept from step to step.

What a request samples with never changes while it lives: its parameters and, when seeded, its
own generator, which outlives preemption so a resumed request keeps drawing where it was. So
the batch of sampling parameters is built once and reused while the same requests sample in
the same order (a run of decode steps). A penalized request carries `TokenCounts`, built from
its history at its first sample and grown by one token per step, so no step reads a whole
history. Both live until the request finishes (`forget`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stillcut.engine.request import SamplingParams
from stillcut.engine.sampler import LogprobsTensors, Sampler, SamplingBatch, TokenCounts
from stillcut.engine.sampler import build_sampling_batch as _build

# request index in the step -> (prompt ids, output ids so far), read once per penalized request
History = Callable[[int], tuple[Sequence[int] | torch.Tensor, Sequence[int]]]


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens (one per sampling request) and, when asked for, their logprobs."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, tuple[list[int], list[float], float]]


class RowSampler:
    """Samples one token per request from its logits row; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
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
    ) -> tuple[list[int], StepResult]:
        """One token per request from `logits` [S, vocab]; returns them and the step result."""
        batch = self._batch(request_ids, params, history, logits.shape[1])
        output = self.sampler(logits, batch)
        token_ids = output.token_ids.tolist()
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            counts = self._token_counts.get(request_id)
            if counts is not None:
                counts.add(token_id)
        sampled = {r: [t] for r, t in zip(request_ids, token_ids, strict=True)}
        logprobs = _logprobs_by_request(request_ids, params, output.logprobs)
        return token_ids, StepResult(sampled, logprobs)

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
