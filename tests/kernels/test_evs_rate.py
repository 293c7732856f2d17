"""Rate mode reproduces vLLM's published retention mask exactly."""

import pytest
import torch

from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.reference import pair_dissimilarity_torch
from stillcut.kernels.evs.reference import published_rate_mask as published_mask


def assert_separated(dissimilarity, min_gap=1e-6):
    """The exactness guarantee holds where distinct values are more than 1e-6 apart."""
    values = torch.unique(dissimilarity)
    if values.numel() > 1:
        assert float((values[1:] - values[:-1]).min()) > min_gap


def check_against_published(embeds, grid, rate):
    expected, published = published_mask(embeds, grid, rate)
    assert_separated(published)
    result = prune(embeds, grid, EVSConfig(mode="rate", rate=rate))
    assert torch.equal(result.mask, expected), (grid, rate)
    hw = grid[1] * grid[2]
    assert bool(result.mask[:hw].all())
    assert torch.all(result.dissimilarity[:hw] == 2.0)
    torch.testing.assert_close(result.dissimilarity[hw:], published[hw:], rtol=0, atol=1e-6)
    return result


RATES = [0.0, 0.2, 0.5, 0.75, 0.9, 0.999]


@pytest.mark.parametrize("grid", [(6, 3, 4), (1, 2, 3), (9, 1, 1), (4, 5, 2)])
@pytest.mark.parametrize("rate", RATES)
def test_random_inputs_match_published(grid, rate):
    t, h, w = grid
    generator = torch.Generator().manual_seed(100 * t + 10 * h + w + int(1000 * rate))
    embeds = torch.randn(t * h * w, 24, generator=generator)
    check_against_published(embeds, grid, rate)


def test_result_fields_follow_the_mask():
    generator = torch.Generator().manual_seed(3)
    grid = (5, 3, 4)
    embeds = torch.randn(60, 16, generator=generator)
    result = check_against_published(embeds, grid, 0.6)
    kept_index = result.mask.nonzero().squeeze(1)
    assert torch.equal(result.kept_index, kept_index)
    assert torch.all(kept_index[1:] > kept_index[:-1])
    t, y, x = result.kept_coords.unbind(1)
    assert torch.equal(t * 12 + y * 4 + x, kept_index)
    assert torch.equal(result.kept_per_tubelet, result.mask.view(5, 12).sum(1))
    assert result.dissimilarity.dtype == torch.float32 and result.kept_coords.dtype == torch.long


def test_duplicate_locations_tie_to_lower_index():
    generator = torch.Generator().manual_seed(4)
    t, h, w, dim = 6, 3, 4, 20
    video = torch.randn(t, h, w, dim, generator=generator)
    # Three locations share one trajectory and two others another, so their dissimilarities
    # tie exactly in every tubelet; each rate cuts through some tie group.
    video[:, 2, 3] = video[:, 0, 1]
    video[:, 1, 0] = video[:, 0, 1]
    video[:, 2, 0] = video[:, 1, 2]
    embeds = video.reshape(-1, dim)
    for rate in [i / 24 for i in range(24)]:
        result = check_against_published(embeds, (t, h, w), rate)
        d = result.dissimilarity.view(t, h, w)
        assert torch.equal(d[:, 2, 3], d[:, 0, 1]) and torch.equal(d[:, 1, 0], d[:, 0, 1])
        assert torch.equal(d[:, 2, 0], d[:, 1, 2])


def test_identical_tokens_everywhere_keep_lowest_indices():
    token = torch.randn(12, generator=torch.Generator().manual_seed(5))
    embeds = token.expand(5 * 6, 12).contiguous()
    for rate in RATES:
        result = check_against_published(embeds, (5, 2, 3), rate)
        assert torch.equal(result.kept_index, torch.arange(result.num_kept_tokens))


def test_static_frames_keep_count_and_first_tubelet():
    generator = torch.Generator().manual_seed(6)
    frame = torch.randn(8, 32, generator=generator)
    embeds = frame.repeat(7, 1)  # every tubelet identical, locations differ
    for rate in RATES:
        expected, _ = published_mask(embeds, (7, 2, 4), rate)
        result = prune(embeds, (7, 2, 4), EVSConfig(mode="rate", rate=rate))
        assert result.num_kept_tokens == int(expected.sum())
        assert bool(result.mask[:8].all())


def test_zero_and_tiny_vectors_follow_cosine_eps():
    generator = torch.Generator().manual_seed(7)
    t, hw, dim = 5, 6, 16
    embeds = torch.randn(t * hw, dim, generator=generator)
    embeds[[0, 7, 8, 13, 20, 26, 27]] = 0.0  # zero after, before and next to non-zero tokens
    embeds[[3, 9, 15]] *= 1e-10  # norms below eps: the clamp shows in the cosine
    for rate in RATES:
        result = check_against_published(embeds, (t, 2, 3), rate)
        # cosine_similarity clamps each norm to eps, so any zero vector has cosine 0.
        assert torch.all(result.dissimilarity[[7, 8, 13, 20, 26, 27]] == 1.0)


def test_antiparallel_tokens_never_outrank_first_tubelet():
    generator = torch.Generator().manual_seed(8)
    frame = torch.randn(6, 64, generator=generator)
    embeds = torch.cat([frame, -frame, frame, -frame])  # dissimilarity 2 (maybe 2 + ulp)
    for rate in RATES:
        expected, _ = published_mask(embeds, (4, 2, 3), rate)
        result = prune(embeds, (4, 2, 3), EVSConfig(mode="rate", rate=rate))
        assert bool(result.mask[:6].all()) and bool(expected[:6].all())
        assert result.num_kept_tokens == int(expected.sum())


def test_fp16_and_bf16_inputs_rank_like_their_fp32_values():
    generator = torch.Generator().manual_seed(9)
    embeds = torch.randn(5 * 12, 32, generator=generator)
    for dtype in (torch.float16, torch.bfloat16):
        low = embeds.to(dtype)
        expected, published = published_mask(low.float(), (5, 3, 4), 0.5)
        assert_separated(published)
        result = prune(low, (5, 3, 4), EVSConfig(mode="rate", rate=0.5))
        assert torch.equal(result.mask, expected)


def test_equal_long_rows_get_bit_identical_dissimilarity():
    # 27 rows of 40k would leave one row alone in its chunk, and torch splits a lone long
    # row's reduction across threads; with this seed that rounds the row differently.
    generator = torch.Generator().manual_seed(6)
    a = torch.randn(40_000, generator=generator)
    b = a + 0.05 * torch.randn(40_000, generator=generator)
    d = pair_dissimilarity_torch(a.expand(27, -1).contiguous(), b.expand(27, -1).contiguous())
    assert torch.all(d == d[0])
