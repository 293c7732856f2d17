"""Sampled tokens inside draft windows follow the target distribution exactly.

A tiny Markov chain over 6 tokens stands in for a model: the logits after token x are row x of
a fixed table. Each draw verifies 3 drafts (a different chain's guesses, so some are accepted
and some rejected) with temperature 1 and top-p 0.9, continuing until two tokens are out; the
joint counts of those two tokens over 4,000 seeded draws must fit the no-speculation
distribution, computed here from the table (chi-square, p > 0.01), and a rejection sampler that
resamples from p instead of the residual must not. Seeded requests repeat exactly with K
pinned, alone and batched, in the engine.
"""

import numpy as np
import pytest
import torch

from stillcut.engine import sampler as sampler_module
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.engine.row_sampler import RowSampler

VOCAB = 6
NUM_DRAFTS = 3
NUM_DRAWS = 4000
PARAMS = SamplingParams(temperature=1.0, top_p=0.9)
START = 0


def _tables():
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(VOCAB, VOCAB, generator=generator) * 1.5  # [prev, next] logits
    guesses = torch.randn(VOCAB, VOCAB, generator=generator).argmax(-1)  # [prev] -> a draft
    return target, guesses


def _nucleus_probs(logits: np.ndarray, top_p: float) -> np.ndarray:
    """transformers' top-p over one row: the smallest most likely set reaching top_p."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.cumsum(probs[order]) - probs[order] < top_p
    kept = np.zeros_like(probs)
    kept[order[keep]] = probs[order[keep]]
    return kept / kept.sum()


def _two_tokens(row_sampler, target, guesses, seed) -> tuple[int, int]:
    """The first two output tokens after START, from verify steps of NUM_DRAFTS drafts."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
    tokens = []
    while len(tokens) < 2:
        previous = tokens[-1] if tokens else START
        drafts = [int(guesses[previous])]
        for _ in range(NUM_DRAFTS - 1):
            drafts.append(int(guesses[drafts[-1]]))
        logits = target[[previous, *drafts]]  # [1 + K, vocab]
        (new,), _ = row_sampler.sample(
            ["r"], [params], lambda i: ([], []), logits, [drafts], [len(tokens)]
        )
        tokens += new
    return tokens[0], tokens[1]


def _chi_square_p(target, guesses) -> tuple[float, int]:
    row_sampler = RowSampler(torch.device("cpu"), keyed_draws=True)
    counts = np.zeros((VOCAB, VOCAB))
    for seed in range(NUM_DRAWS):
        first, second = _two_tokens(row_sampler, target, guesses, seed)
        counts[first, second] += 1
    logits = target.numpy().astype(np.float64)
    first_probs = _nucleus_probs(logits[START], PARAMS.top_p)
    expected = np.stack([p * _nucleus_probs(logits[x], PARAMS.top_p) for x, p in
                         enumerate(first_probs)]) * NUM_DRAWS  # fmt: skip
    assert counts[expected == 0].sum() == 0, "a token outside the nucleus was sampled"
    cells = expected > 0
    chi_square = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    dof = int(cells.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi_square / 2)))
    # the first token equals the first draft exactly when that draft was accepted
    return p_value, int(counts[int(guesses[START])].sum())


def test_tokens_in_draft_windows_follow_the_target_distribution():
    target, guesses = _tables()
    p_value, accepted_first = _chi_square_p(target, guesses)
    assert 0 < accepted_first < NUM_DRAWS  # drafts were both accepted and rejected
    assert p_value > 0.01, p_value


def test_a_sampler_resampling_from_p_itself_is_caught(monkeypatch):
    """Without removing the rejected draft, the draft's token is drawn too often."""

    def resample_from_p(probs, draft_ids, generators):
        accepted = draft_ids >= 0
        uniform = torch.rand(len(draft_ids))
        draft_probs = probs.gather(1, draft_ids.clamp(min=0)[:, None]).squeeze(1)
        accepted &= uniform < draft_probs / probs.sum(-1)
        return torch.where(accepted, draft_ids, sampler_module.exponential_race(probs, generators))

    monkeypatch.setattr(sampler_module, "rejection_race", resample_from_p)
    target, guesses = _tables()
    p_value, _ = _chi_square_p(target, guesses)
    assert p_value < 0.01, p_value


@pytest.fixture(scope="module")
def gemma_engine():
    path = cached_checkpoint("tiny", family="gemma3")
    speculative = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, dynamic=False
    )
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=512),
        cache=CacheConfig(num_blocks=256),
        speculative=speculative,
    )
    return LLMEngine(path, config)


def test_seeded_request_repeats_alone_and_batched(gemma_engine):
    engine = gemma_engine
    text = "red green blue red green blue red green blue red green"
    prompt = engine.processor.build([{"role": "user", "content": [{"type": "text", "text": text}]}])
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_k=2, seed=7, ignore_eos=True)
    (alone,) = engine.generate([prompt], seeded)
    (again,) = engine.generate([prompt], seeded)
    others = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)
    ]
    batched = engine.generate([prompt, prompt, prompt], [others[0], seeded, others[1]])
    assert alone.token_ids == again.token_ids == batched[1].token_ids
    assert alone.metrics.num_draft_tokens > 0
