"""Threshold mode: causal keep decisions against the last kept token, streaming, cap and floor."""

import math

import pytest
import torch
import torch.nn.functional as F

from stillcut.kernels.evs import EVSConfig, ThresholdPruner, prune


def straightforward_threshold(embeds, grid, tau, cap=None, floor=0):
    """Threshold mode spelled out location by location, with torch's cosine_similarity."""
    t, h, w = grid
    hw = h * w
    video = embeds.view(t, hw, -1)
    reference = video[0].clone()
    mask = torch.zeros(t, hw, dtype=torch.bool)
    mask[0] = True
    for step in range(1, t):
        d = 1 - F.cosine_similarity(video[step], reference, dim=-1)
        # The guarantee is exact only away from tau and from near ties.
        assert float((d - tau).abs().min()) > 1e-5
        ranked = sorted(range(hw), key=lambda i: (-float(d[i]), i))
        num_kept = sum(float(d[i]) >= tau for i in range(hw))
        num_kept = max(num_kept, min(floor, hw))
        if cap is not None:
            num_kept = min(num_kept, cap)
        for i in ranked[:num_kept]:
            mask[step, i] = True
            reference[i] = video[step, i]
    return mask.view(-1)


def rotating_video(t, steps, dim=8):
    """Location i turns by `steps[i]` radians per tubelet in its own plane."""
    video = torch.zeros(t, len(steps), dim)
    for i, step in enumerate(steps):
        angle = torch.arange(t, dtype=torch.float64) * step
        video[:, i, (2 * i) % dim] = angle.cos().float()
        video[:, i, (2 * i + 1) % dim] = angle.sin().float()
    return video.reshape(t * len(steps), dim)


def push_in_chunks(config, embeds, grid, chunks):
    t, h, w = grid
    pruner = ThresholdPruner(config, (h, w), embeds.shape[1], dtype=embeds.dtype)
    results, start = [], 0
    for n in chunks:
        results.append(pruner.push(embeds[start * h * w : (start + n) * h * w]))
        start += n
    assert start == t and pruner.num_tubelets == t
    return results


CONFIGS = [
    EVSConfig(mode="threshold", threshold=0.9),
    EVSConfig(mode="threshold", threshold=0.9, max_per_tubelet=3, floor=1),
    EVSConfig(mode="threshold", threshold=1.9, floor=4),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.key())
@pytest.mark.parametrize("chunks", [[1] * 7, [2, 1, 3, 1], [3, 4]])
def test_streaming_equals_whole_clip(config, chunks):
    generator = torch.Generator().manual_seed(10)
    grid = (7, 2, 3)
    # Small random steps so that references age and later keeps depend on earlier ones.
    steps = 0.6 * torch.randn(7, 6, 16, generator=generator)
    embeds = steps.cumsum(0).reshape(42, 16) + torch.randn(16, generator=generator)
    whole = prune(embeds, grid, config)
    parts = push_in_chunks(config, embeds, grid, chunks)
    assert torch.equal(torch.cat([p.mask for p in parts]), whole.mask)
    assert torch.equal(torch.cat([p.dissimilarity for p in parts]), whole.dissimilarity)
    assert torch.equal(torch.cat([p.kept_coords for p in parts]), whole.kept_coords)
    assert torch.equal(torch.cat([p.kept_per_tubelet for p in parts]), whole.kept_per_tubelet)
    offsets, start = [], 0
    for n, part in zip(chunks, parts, strict=True):
        offsets.append(part.kept_index + start * 6)
        start += n
    assert torch.equal(torch.cat(offsets), whole.kept_index)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.key())
def test_matches_straightforward_transcription(config):
    generator = torch.Generator().manual_seed(11)
    grid = (6, 3, 3)
    steps = 0.7 * torch.randn(6, 9, 12, generator=generator)
    embeds = steps.cumsum(0).reshape(54, 12) + torch.randn(12, generator=generator)
    expected = straightforward_threshold(
        embeds, grid, config.threshold, config.max_per_tubelet, config.floor
    )
    result = prune(embeds, grid, config)
    assert torch.equal(result.mask, expected)
    assert torch.all(result.dissimilarity[:9] == 2.0)


def test_static_clip_keeps_exactly_the_first_tubelet():
    frame = torch.randn(12, 32, generator=torch.Generator().manual_seed(12))
    embeds = frame.repeat(9, 1)
    result = prune(embeds, (9, 3, 4), EVSConfig(mode="threshold", threshold=0.01))
    assert torch.equal(result.kept_index, torch.arange(12))
    assert result.kept_per_tubelet.tolist() == [12] + [0] * 8


def test_slow_drift_is_caught_and_reference_resets():
    tau = 0.1  # 1 - cos(angle) >= tau from about 0.451 rad
    steps = [0.2, 0.5, 0.0, 0.16]  # every 3rd, every, never, every 3rd tubelet
    t = 10
    embeds = rotating_video(t, steps)
    result = prune(embeds, (t, 2, 2), EVSConfig(mode="threshold", threshold=tau))
    mask = result.mask.view(t, 4)
    every_third = [step % 3 == 0 for step in range(t)]
    assert mask[:, 0].tolist() == every_third
    assert mask[:, 1].all() and mask[1:, 2].sum() == 0
    assert mask[:, 3].tolist() == every_third
    # Against the last kept token, not the previous tubelet: drift accumulates, then resets.
    d = result.dissimilarity.view(t, 4)[:, 0].double()
    expected = [1 - math.cos(0.2), 1 - math.cos(0.4), 1 - math.cos(0.6), 1 - math.cos(0.2)]
    torch.testing.assert_close(
        d[1:5], torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_cap_keeps_most_dissimilar_candidates():
    generator = torch.Generator().manual_seed(13)
    embeds = torch.randn(5 * 8, 16, generator=generator)
    config = EVSConfig(mode="threshold", threshold=0.0, max_per_tubelet=2)
    result = prune(embeds, (5, 2, 4), config)
    assert result.kept_per_tubelet.tolist() == [8, 2, 2, 2, 2]
    expected = straightforward_threshold(embeds, (5, 2, 4), 0.0, cap=2)
    assert torch.equal(result.mask, expected)


def test_floor_tops_up_with_most_dissimilar():
    generator = torch.Generator().manual_seed(14)
    embeds = torch.randn(5 * 8, 16, generator=generator)
    result = prune(embeds, (5, 2, 4), EVSConfig(mode="threshold", threshold=2.0, floor=3))
    assert result.kept_per_tubelet.tolist() == [8, 3, 3, 3, 3]
    d = result.dissimilarity.view(5, 8)
    mask = result.mask.view(5, 8)
    for step in range(1, 5):
        assert float(d[step][mask[step]].min()) > float(d[step][~mask[step]].max())
    result = prune(embeds, (5, 2, 4), EVSConfig(mode="threshold", threshold=2.0, floor=20))
    assert bool(result.mask.all())


def test_cap_and_floor_ties_go_to_lower_index():
    u, v, w = torch.eye(3)
    frames = [u, v, w, u, v]  # every location turns by 90 degrees: all tie at 1.0
    embeds = torch.stack(frames).repeat_interleave(6, dim=0)  # [5 * 6, 3]
    capped = EVSConfig(mode="threshold", threshold=0.5, max_per_tubelet=2)
    floored = EVSConfig(mode="threshold", threshold=1.5, floor=2)
    for config in (capped, floored):
        result = prune(embeds, (5, 2, 3), config)
        assert result.kept_per_tubelet.tolist() == [6, 2, 2, 2, 2]
        assert result.kept_coords[6:, 1:].tolist() == [[0, 0], [0, 1]] * 4


def test_reset_starts_a_new_stream():
    generator = torch.Generator().manual_seed(15)
    config = EVSConfig(mode="threshold", threshold=0.5)
    pruner = ThresholdPruner(config, (2, 2), 8)
    first = pruner.push(torch.randn(8, 8, generator=generator))
    assert pruner.num_tubelets == 2 and first.kept_per_tubelet[0] == 4
    pruner.reset()
    assert pruner.num_tubelets == 0
    again = pruner.push(torch.randn(4, 8, generator=generator))
    assert again.kept_index.tolist() == [0, 1, 2, 3] and again.kept_coords[:, 0].tolist() == [0] * 4


def test_pruner_rejects_bad_inputs():
    config = EVSConfig(mode="threshold", threshold=0.5)
    with pytest.raises(ValueError, match="needs an EVSConfig with mode='threshold'"):
        ThresholdPruner(EVSConfig(mode="rate", rate=0.5), (2, 2), 8)
    with pytest.raises(ValueError, match=r"grid_hw=\(2, 0\) must be 2 integers >= 1"):
        ThresholdPruner(config, (2, 0), 8)
    pruner = ThresholdPruner(config, (2, 2), 8)
    with pytest.raises(ValueError, match="embeds has 6 tokens; expected a positive multiple of"):
        pruner.push(torch.randn(6, 8))
    with pytest.raises(ValueError, match="embeds has 0 tokens"):
        pruner.push(torch.randn(0, 8))
    with pytest.raises(ValueError, match="embeds dim 7 does not match dim=8"):
        pruner.push(torch.randn(4, 7))
    with pytest.raises(ValueError, match="this pruner holds torch.float32"):
        pruner.push(torch.randn(4, 8, dtype=torch.bfloat16))
    assert pruner.num_tubelets == 0
