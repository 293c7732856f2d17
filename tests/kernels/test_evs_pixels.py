"""The pixel stage's features: each merge group's pixels less its frame's mean colour, plus a
constant floor coordinate, compared by the EVS kernels' `1 - cos`."""

import torch

from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.pixels import PIXEL_FLOOR, group_features
from stillcut.kernels.evs.reference import pair_dissimilarity_torch

CHANNELS, FRAMES, PIXELS = 3, 2, 16  # a patch row: channel, frame, 4x4 pixels
GROUP = 4


def tubelets(count: int, groups: int, seed: int = 0) -> torch.Tensor:
    """[count * groups * GROUP, CHANNELS * FRAMES * PIXELS] random normalised patches."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count * groups * GROUP, CHANNELS * FRAMES * PIXELS, generator=generator)


def features(patches: torch.Tensor, count: int) -> torch.Tensor:
    return group_features(patches, GROUP, count, CHANNELS, FRAMES)


def test_a_frame_wide_brightness_change_is_no_change():
    patches = tubelets(1, 6)
    brighter = patches.view(-1, CHANNELS, FRAMES, PIXELS).clone()
    brighter[:, :, 1] += 0.3  # the second frame's every pixel, every channel
    before, after = features(patches, 1), features(brighter.view_as(patches), 1)
    torch.testing.assert_close(after, before)
    local = patches.clone()
    local[:GROUP] += 0.3  # one group only: it changed, the others barely
    changed = pair_dissimilarity_torch(features(local, 1), before)
    assert changed[0] > 10 * changed[1:].max()


def test_groups_near_their_frames_mean_compare_by_their_change_not_their_direction():
    flat = torch.zeros(2 * GROUP, CHANNELS * FRAMES * PIXELS)
    flat[:GROUP] = 0.01 * torch.randn(GROUP, CHANNELS * FRAMES * PIXELS)  # noise around the mean
    noisy = flat.clone()
    noisy[:GROUP] = 0.01 * torch.randn(GROUP, CHANNELS * FRAMES * PIXELS)  # other noise
    dissimilarity = pair_dissimilarity_torch(features(noisy, 1), features(flat, 1))
    # plain cosines of two noise vectors would be ~1; the floor makes it ~ squared change / 2
    plain = 1 - torch.nn.functional.cosine_similarity(
        noisy[:GROUP].flatten(), flat[:GROUP].flatten(), 0
    )
    assert plain > 0.5 and dissimilarity[0] < 1e-3
    assert features(flat, 1)[0, -1] == PIXEL_FLOOR * (GROUP * CHANNELS * FRAMES * PIXELS) ** 0.5


def test_tubelets_are_centred_on_their_own_frames_so_streaming_equals_the_whole_clip():
    patches = tubelets(3, 5, seed=1)
    whole = features(patches, 3)
    rows = patches.shape[0] // 3
    streamed = torch.cat([features(patches[k * rows : (k + 1) * rows], 1) for k in range(3)])
    torch.testing.assert_close(whole, streamed)
    evs = EVSConfig(mode="threshold", threshold=0.2, stage="pixels")
    dissimilarity = prune(whole, (3, 1, 5), evs).dissimilarity
    assert 0.0 <= float(dissimilarity.min()) and float(dissimilarity.max()) <= 2.0
