"""The engine's side of speculative decoding: after each step, drafts for every decoding
request, K chosen for the step by the policy; counters for metrics.

A request proposes only while it decodes: its prompt is complete, its last sampled token is
all that is left to compute, and it is not a held prefix. The drafts go into
`request.spec_token_ids`, which the scheduler trims to its budget and verifies next step.
"""

from __future__ import annotations

from collections.abc import Sequence

from stillcut.engine.config import SpeculativeConfig
from stillcut.engine.request import Request, RequestStatus
from stillcut.engine.spec_decode.policy import SpeculationPolicy
from stillcut.engine.spec_decode.proposer import Proposer


class Speculator:
    """Owns the proposer and the policy; `propose` after every step, `finish` per request."""

    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, policy: SpeculationPolicy
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = policy
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # verify steps by how many of their drafts were accepted: index j counts j accepted
        self.accepted_per_step = [0] * (config.num_speculative_tokens + 1)

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` of every running request: drafts for decoding ones, [] else."""
        decoding = [r for r in running if _decoding(r)]
        for request in running:
            request.spec_token_ids = []
        if not decoding:
            return
        ks = self.policy.num_tokens(decoding)
        for request, drafts in zip(decoding, self.proposer.propose(decoding, ks), strict=True):
            request.spec_token_ids = list(drafts)

    def record(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        """A verify step of `request` scored `num_drafts` and yielded `num_sampled` tokens."""
        if num_drafts:
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_sampled - 1
            self.accepted_per_step[num_sampled - 1] += 1
            self.policy.observe(request, num_drafts, num_sampled - 1)

    def finish(self, request: Request) -> None:
        self.proposer.finish(request)
        self.policy.forget(request)


def _decoding(request: Request) -> bool:
    return (
        request.status is RequestStatus.RUNNING
        and not request.hold
        and bool(request.output_token_ids)
        and request.num_computed_tokens == request.num_tokens - 1
    )
