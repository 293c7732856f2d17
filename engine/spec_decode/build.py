"""Building the speculator an engine's `SpeculativeConfig` asks for, or refusing it."""

from __future__ import annotations

from stillcut.engine.config import SpeculativeConfig
from stillcut.engine.spec_decode.calibration import measure_step_costs
from stillcut.engine.spec_decode.ngram import NgramProposer
from stillcut.engine.spec_decode.policy import SpeculationPolicy
from stillcut.engine.spec_decode.speculator import Speculator
from stillcut.engine.spec_decode.suffix import SuffixProposer


def build_speculator(engine, config: SpeculativeConfig) -> Speculator:
    """The proposer of `config.method` and the K policy (calibrated when dynamic) of `engine`,
    whose model, runner and scheduler config are already built."""
    draft_runner = None  # a draft model's proposals cost steps of its own
    if config.method == "ngram":
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.method == "suffix":
        proposer = SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from stillcut.engine.spec_decode.draft import DraftProposer

        proposer = DraftProposer.for_target(engine, config)
        draft_runner = proposer.runner
    step_cost = None
    if config.dynamic:
        max_batch, max_k = engine.config.scheduler.max_num_seqs, config.num_speculative_tokens
        step_cost = measure_step_costs(engine.runner, max_batch, max_k, draft_runner)
    return Speculator(config, proposer, SpeculationPolicy(config, step_cost))
