"""How many tokens each decoding request proposes this step.

The batch-size table (`SpeculativeConfig.k_per_batch`, like vLLM's
`num_speculative_tokens_per_batch_size`) caps K. With `dynamic`, K is further chosen for the
step to maximise its expected tokens per second: a request whose drafts were accepted with
per-token rate a yields 1 + a + ... + a^K tokens from a verify step of K drafts, and a step of
K drafts per request costs `step_cost(batch, K)` times a plain decode step (measured at
start-up, `calibration`). One K for every decoding request, because the step is shared: a
request that stays at K = 0 beside others that verify pays the dearer step for one token, and
the batch's slowest request bounds it (measured at batch 4, acceptance 0.9, per-request
choices: 43 steps at K = 1 beside 44 at K = 0 took as many steps as no speculation and gave
0.8x its tokens/s). K = 0 wherever no K beats plain decoding by a margin (`MARGIN`), so
speculation never slows serving down by choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stillcut.engine.config import SpeculativeConfig
from stillcut.engine.request import Request

# Prior acceptance of a request with no verify steps yet, and how fast measurements replace it:
# worth two decided drafts, so where a verify step of K costs 1 + 0.18 K plain steps (batch 1
# here) a request whose drafts all fail stops speculating after four verify steps (with a
# weight of 4 it took seven, and cost 5% of its speed at acceptance 0).
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0

# What a verify step costs beyond the calibrated model step (sampling and host work per row,
# which the calibration does not time): speculation must promise this much more to be chosen.
# Measured: at batch 4 and acceptance 0.5 the calibration promised 1.02x and gave 0.83x.
MARGIN = 1.1

# (batch size, K) -> cost of a verify step of K drafts per request relative to K = 0
StepCost = Callable[[int, int], float]


class SpeculationPolicy:
    """K per request and step; see the module docstring."""

    def __init__(self, config: SpeculativeConfig, step_cost: StepCost | None = None) -> None:
        assert not config.dynamic or step_cost is not None, "dynamic K needs measured costs"
        self.config = config
        self.step_cost = step_cost
        self._stats: dict[str, tuple[float, float]] = {}  # request id -> (drafts, accepted)

    def num_tokens(self, requests: Sequence[Request]) -> list[int]:
        """K for each of a step's decoding `requests` (the same K for all)."""
        batch_size = len(requests)
        k_max = self.config.k_for_batch(batch_size)
        if not self.config.dynamic or k_max == 0:
            return [k_max] * batch_size
        rates = [self.acceptance(r) for r in requests]
        gains = [1.0] + [
            sum(sum(rate**i for i in range(k + 1)) for rate in rates)
            / (batch_size * self.step_cost(batch_size, k) * MARGIN)
            for k in range(1, k_max + 1)
        ]
        return [max(range(k_max + 1), key=gains.__getitem__)] * batch_size

    def acceptance(self, request: Request) -> float:
        """The request's chance that a draft is accepted given the ones before it were, so
        far (accepted drafts over drafts decided: accepted ones and first rejections)."""
        decided, accepted = self._stats.get(request.request_id, (0.0, 0.0))
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (decided + PRIOR_WEIGHT)

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step accepted `num_accepted` of `num_drafts` (drafts after the first
        rejected one were never decided: they say nothing about the rate)."""
        decided, accepted = self._stats.get(request.request_id, (0.0, 0.0))
        decided += num_accepted + (num_accepted < num_drafts)
        self._stats[request.request_id] = (decided, accepted + num_accepted)

    def forget(self, request: Request) -> None:
        self._stats.pop(request.request_id, None)
