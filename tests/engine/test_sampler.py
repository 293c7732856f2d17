"""Sampler: parity of every logits transform with transformers' processors, greedy and limit
cases, seeded draws independent of the batch, sampled frequencies, logprobs."""

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stillcut.engine.request import SamplingParams
from stillcut.engine.sampler import (
    Sampler,
    SamplingBatch,
    TokenCounts,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    build_sampling_batch,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def make_batch(
    params, prompts=None, outputs=None, generators=None, device="cpu", vocab=64
) -> SamplingBatch:
    """A batch of `params`; with token histories, every row gets its `TokenCounts`."""
    n = len(params)
    counts = [None] * n
    if prompts is not None or outputs is not None:
        prompts = prompts if prompts is not None else [[]] * n
        outputs = outputs if outputs is not None else [[]] * n
        counts = [TokenCounts(p, o, vocab, device) for p, o in zip(prompts, outputs, strict=True)]
    return build_sampling_batch(
        params, counts, generators if generators is not None else [None] * n, device
    )


def seeded(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def random_logits(num_reqs: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_reqs, vocab, generator=seeded(seed)) * scale


# --- each transform equals transformers' processor, row by row, with per-row parameters -------


def test_temperature_matches_transformers():
    logits = random_logits(4, 32, seed=1)
    temperatures = [0.5, 1.0, 1.7, 0.0]
    out = apply_temperature(logits, torch.tensor(temperatures))
    for row, t in enumerate(temperatures[:3]):
        expected = TemperatureLogitsWarper(t)(None, logits[row : row + 1])
        torch.testing.assert_close(out[row : row + 1], expected)
    torch.testing.assert_close(out[3], logits[3])  # greedy row untouched


def test_repetition_penalty_matches_transformers():
    vocab = 40
    logits = random_logits(4, vocab, seed=2)
    # id 45 is outside the lm_head (embedding vocab larger than the output one): never penalized
    prompts = [[1, 2, 3, 2], [5, 45], [], [7, 8, 9, 10, 11]]
    outputs = [[3, 4], [], [12, 12, 13], [7, 30]]
    penalties = [1.0, 1.3, 0.7, 2.0]
    params = [SamplingParams(temperature=1.0, repetition_penalty=p) for p in penalties]
    out = apply_penalties(logits, make_batch(params, prompts, outputs, vocab=vocab))
    for row, penalty in enumerate(penalties):
        # transformers < 5.24 fails on ids outside the vocab instead of skipping them
        input_ids = torch.tensor([[t for t in prompts[row] + outputs[row] if t < vocab]])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits[row : row + 1])
        torch.testing.assert_close(out[row : row + 1], expected)


@pytest.mark.parametrize("sort_path", [False, True])
def test_top_k_matches_transformers_including_ties(sort_path):
    logits = torch.randint(0, 6, (5, 32), generator=seeded(3)).float()  # many ties at the k-th
    top_ks = [1, 3, 0, 40, 7]
    # top_p = 1 forces the sorted path without filtering anything more
    top_p = torch.ones(5) if sort_path else None
    out = apply_top_k_top_p(logits, torch.tensor(top_ks), top_p)
    for row, k in enumerate(top_ks):
        expected = TopKLogitsWarper(k)(None, logits[row : row + 1]) if k else logits[row : row + 1]
        torch.testing.assert_close(out[row : row + 1], expected)


def test_top_p_matches_transformers():
    logits = random_logits(5, 32, seed=4)
    top_ps = [0.1, 0.5, 0.9, 0.99, 1.0]
    out = apply_top_k_top_p(logits, None, torch.tensor(top_ps))
    for row, p in enumerate(top_ps):
        expected = TopPLogitsWarper(p)(None, logits[row : row + 1])
        torch.testing.assert_close(out[row : row + 1], expected)
    assert (out.isfinite().sum(-1) >= 1).all()


def test_top_k_then_top_p_matches_transformers():
    logits = random_logits(4, 32, seed=5, scale=1.0)
    settings = [(5, 0.9), (0, 0.6), (20, 0.3), (2, 1.0)]
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    out = apply_top_k_top_p(logits, top_k, top_p)
    for row, (k, p) in enumerate(settings):
        expected = logits[row : row + 1]
        if k:
            expected = TopKLogitsWarper(k)(None, expected)
        expected = TopPLogitsWarper(p)(None, expected)
        torch.testing.assert_close(out[row : row + 1], expected)


def test_min_p_matches_transformers():
    logits = random_logits(4, 32, seed=6)
    min_ps = [0.0, 0.05, 0.3, 1.0]
    probs = apply_min_p(logits.softmax(-1), torch.tensor(min_ps))
    for row, m in enumerate(min_ps):
        expected = MinPLogitsWarper(m)(None, logits[row : row + 1]).softmax(-1)[0]
        assert torch.equal(probs[row] > 0, expected > 0)
        torch.testing.assert_close(probs[row] / probs[row].sum(), expected)


def test_presence_and_frequency_penalties_by_hand():
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5], [1.0, 2.0, 3.0, -1.0, 0.5]])
    params = [
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=2.0),
    ]
    prompts = [[2], [2]]  # the prompt counts for repetition only, never for presence/frequency
    outputs = [[1, 1, 3], [1, 3]]
    out = apply_penalties(logits, make_batch(params, prompts, outputs, vocab=5))
    expected = torch.tensor(
        [
            # token 1: 2 - 2 * 0.25 - 0.5; token 3: -1 - 0.25 - 0.5
            [1.0, 1.0, 3.0, -1.75, 0.5],
            # repetition first (1, 2, 3 seen: 2 / 2, 3 / 2, -1 * 2), then presence on 1 and 3
            [1.0, 0.5, 1.5, -2.5, 0.5],
        ]
    )
    torch.testing.assert_close(out, expected)


# --- greedy and the limits that must collapse to it --------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_index():
    logits = random_logits(4, 16, seed=7)
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1.0
    params = [
        SamplingParams(),
        SamplingParams(temperature=1e-7, top_k=3, top_p=0.5),
        SamplingParams(),
        SamplingParams(),
    ]
    out = Sampler()(logits, make_batch(params))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[0] == 3


def test_greedy_rows_in_a_mixed_batch_take_the_penalized_argmax():
    logits = random_logits(6, 64, seed=8)
    params = [SamplingParams(repetition_penalty=3.0), SamplingParams(temperature=1.0)] * 3
    outputs = [[int(logits[row].argmax())] for row in range(6)]  # penalize each row's argmax
    batch = make_batch(params, outputs=outputs)
    out = Sampler()(logits, batch)
    expected = apply_penalties(logits, batch).argmax(-1)
    assert torch.equal(out.token_ids[0::2], expected[0::2])
    assert not torch.equal(expected[0::2], logits.argmax(-1)[0::2])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-3),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=0.999),
    ],
    ids=["temperature_to_zero", "top_k_1", "top_p_tiny", "min_p_near_1"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_limits_that_collapse_to_greedy(params, device):
    torch.manual_seed(0)
    logits = random_logits(64, 100, seed=9).to(device)
    top = logits.argmax(-1)
    logits[torch.arange(64), top] += 0.05  # a margin so 1e-3 temperature leaves no doubt
    generators = [seeded(row, device) if row % 2 else None for row in range(64)]
    out = Sampler()(logits, make_batch([params] * 64, generators=generators, device=device))
    assert torch.equal(out.token_ids, top)
    # the same rows at temperature 1 without filters do sample away from the argmax
    free = Sampler()(
        logits,
        make_batch([SamplingParams(temperature=1.0)] * 64, generators=generators, device=device),
    )
    assert (free.token_ids != top).sum() > 10


# --- seeded rows are reproducible whatever the batch -------------------------------------------


def step_logits(key: int, step: int, vocab: int = 96) -> torch.Tensor:
    return random_logits(1, vocab, seed=1000 * key + step)[0]


def run_steps(requests, device: str, num_steps: int = 6) -> list[list[int]]:
    """requests: (params, seed or None, logits key); each step feeds back the sampled tokens."""
    generators = [None if seed is None else seeded(seed, device) for _, seed, _ in requests]
    counts = [TokenCounts(range(key, key + 6), [], 96, device) for _, _, key in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    sampler = Sampler()
    for step in range(num_steps):
        logits = torch.stack([step_logits(key, step) for _, _, key in requests]).to(device)
        batch = build_sampling_batch([p for p, _, _ in requests], counts, generators, device)
        for row, token in enumerate(sampler(logits, batch).token_ids.tolist()):
            outputs[row].append(token)
            counts[row].add(token)
    return outputs


FILTERED = SamplingParams(
    temperature=0.9,
    top_p=0.95,
    top_k=40,
    min_p=0.02,
    repetition_penalty=1.2,
    presence_penalty=0.3,
    frequency_penalty=0.2,
)
PLAIN = SamplingParams(temperature=1.0)  # alone it takes the fast path: no sort, no penalties
NEIGHBOURS = [
    [(SamplingParams(), None, 50), (SamplingParams(temperature=1.0), None, 51)],
    [
        (SamplingParams(temperature=0.7, top_k=5), 7, 52),
        (SamplingParams(logprobs=3), None, 53),
        (PLAIN, 8, 54),
    ],
    [(SamplingParams(temperature=1.3, top_p=0.5, repetition_penalty=1.5), None, 55)] * 3,
]


@pytest.mark.parametrize("target", [FILTERED, PLAIN], ids=["filtered", "plain"])
@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_draws_the_same_tokens_alone_and_batched(target, device):
    torch.manual_seed(0)
    me = (target, 1234, 1)
    alone = run_steps([me], device)[0]
    for neighbours in NEIGHBOURS:
        for position in range(len(neighbours) + 1):
            requests = neighbours[:position] + [me] + neighbours[position:]
            assert run_steps(requests, device)[position] == alone
    other_seed = run_steps([(target, 4321, 1)], device)[0]
    assert other_seed != alone


# --- sampled frequencies match the processed distribution --------------------------------------

LOGITS_6 = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -0.5])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert (counts[probs == 0] == 0).all(), "a filtered token was sampled"
    expected = probs.double() * tokens.numel()
    kept = probs > 0
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


@pytest.mark.parametrize("seeded_rows", [True, False], ids=["own_generators", "default_generator"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.1),
    ],
    ids=["temperature", "filtered"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_sampled_frequencies_match_probabilities(params, seeded_rows, device):
    torch.manual_seed(0)
    num_samples = 4000
    logits = LOGITS_6.expand(num_samples, -1).to(device)
    generators = [seeded(i, device) if seeded_rows else None for i in range(num_samples)]
    batch = make_batch([params] * num_samples, generators=generators, device=device)
    tokens = Sampler()(logits, batch).token_ids.cpu()
    expected = TemperatureLogitsWarper(params.temperature)(None, LOGITS_6[None])
    if params.top_k:
        expected = TopKLogitsWarper(params.top_k)(None, expected)
    expected = TopPLogitsWarper(params.top_p)(None, expected)
    expected = MinPLogitsWarper(params.min_p)(None, expected).softmax(-1)[0]
    # at most 5 degrees of freedom: 30 is far beyond the 0.1% point (20.5) yet catches any bias
    assert chi_square(tokens, expected) < 30.0


# --- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_those_of_the_raw_logits(device):
    logits = random_logits(4, 64, seed=10).to(device)
    params = [
        SamplingParams(temperature=0.7, top_k=10, repetition_penalty=1.5, logprobs=5),
        SamplingParams(logprobs=2, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=0),
    ]
    generators = [seeded(1, device)] * 4
    batch = make_batch(params, outputs=[[1, 2], [3], [], [4]], generators=generators, device=device)
    before = logits.clone()
    out = Sampler()(logits, batch)
    assert torch.equal(logits, before), "the sampler must not modify its input"
    raw = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprobs.top_token_ids, top_ids)
    torch.testing.assert_close(out.logprobs.top_logprobs, top_values)
    torch.testing.assert_close(
        out.logprobs.sampled_logprobs, raw[torch.arange(4, device=device), out.token_ids]
    )


def test_logprobs_absent_or_sampled_only():
    logits = random_logits(2, 16, seed=11)
    assert Sampler()(logits, make_batch([SamplingParams(), SamplingParams()])).logprobs is None
    out = Sampler()(logits, make_batch([SamplingParams(logprobs=0), SamplingParams()]))
    assert out.logprobs.top_token_ids.shape == (2, 0)
    torch.testing.assert_close(
        out.logprobs.sampled_logprobs, torch.log_softmax(logits, -1).max(-1).values
    )


# --- batch building ------------------------------------------------------------------------------


def test_unused_parameters_take_the_fast_path(monkeypatch):
    batch = make_batch(
        [SamplingParams(temperature=1.0, top_k=3), SamplingParams(top_p=0.5, min_p=0.2)]
    )
    # the greedy row's filters are off; no row has penalties or top-p
    assert batch.top_p is None and batch.min_p is None and batch.output_counts is None
    assert batch.top_k.tolist() == [3, 0]

    def no_sort(*args, **kwargs):
        raise AssertionError("top-k alone must not sort the vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    Sampler()(random_logits(2, 32, seed=12), batch)


def test_batch_building_stacks_token_counts_and_drops_greedy_generators():
    generator = seeded(0)
    params = [
        SamplingParams(presence_penalty=0.1),
        SamplingParams(temperature=1.0, repetition_penalty=1.1),
        SamplingParams(temperature=1.0),  # unpenalized: no counts needed, zeros in the batch
    ]
    counts = [TokenCounts([1, 2, 3, 9], [], 8), TokenCounts([4], torch.tensor([5, 6, 5]), 8)]
    batch = build_sampling_batch(params, [*counts, None], [generator] * 3, "cpu")
    assert batch.prompt_mask.nonzero().tolist() == [[0, 1], [0, 2], [0, 3], [1, 4]]  # 9 > vocab
    assert batch.output_counts.tolist() == [[0.0] * 8, [0, 0, 0, 0, 0, 2, 1, 0], [0.0] * 8]
    assert batch.generators == (None, generator, generator)
    assert batch.frequency_penalty.tolist() == [0.0, 0.0, 0.0]
    assert not batch.all_greedy and not batch.all_random
    with pytest.raises(ValueError, match=r"row 0 has a penalty but token_counts\[0\] is None"):
        build_sampling_batch(params, [None, *counts], [generator] * 3, "cpu")


def test_token_counts_grow_one_token_at_a_time_as_if_rebuilt():
    grown = TokenCounts([3, 3, 70], [5], vocab_size=64)
    for token in [5, 0, 63, 5]:
        grown.add(token)
    rebuilt = TokenCounts([3, 3, 70], [5, 5, 0, 63, 5], vocab_size=64)
    assert torch.equal(grown.output_counts, rebuilt.output_counts)
    assert torch.equal(grown.prompt_mask, rebuilt.prompt_mask)
    assert grown.output_counts[5] == 3 and grown.prompt_mask.sum() == 1


def test_invalid_batches_name_the_field():
    with pytest.raises(ValueError, match="generators"):
        build_sampling_batch([SamplingParams()], [None], [], "cpu")
    with pytest.raises(ValueError, match="top_k"):
        SamplingBatch(
            temperature=torch.zeros(2),
            generators=(None, None),
            all_greedy=True,
            all_random=False,
            top_k=torch.zeros(3, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="output_counts"):
        SamplingBatch(
            temperature=torch.zeros(1),
            generators=(None,),
            all_greedy=True,
            all_random=False,
            repetition_penalty=torch.ones(1),
            presence_penalty=torch.zeros(1),
            frequency_penalty=torch.zeros(1),
        )
