"""Triton kernels against the torch reference (CPU runs use TRITON_INTERPRET=1)."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from stillcut.kernels.evs import EVSConfig, ThresholdPruner, prune
from stillcut.kernels.evs.ops import triton_kernels
from stillcut.kernels.evs.reference import pair_dissimilarity_torch

pytest.importorskip("triton")
from stillcut.kernels.evs.triton_kernels import pair_dissimilarity_triton  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def drifting_clip(t, hw, dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    steps = 0.7 * torch.randn(t, hw, dim, generator=generator)
    return (steps.cumsum(0) + torch.randn(dim, generator=generator)).reshape(t * hw, dim).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [5, 48, 1100])  # below, inside and across BLOCK_D
def test_pair_dissimilarity_matches_torch(dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    a = torch.randn(6, dim, generator=generator).to(dtype)
    b = torch.randn(6, dim, generator=generator).to(dtype)
    b[1] = a[1]  # identical rows
    b[2] = -a[2]  # opposite rows
    a[3] = 0.0  # zero row: cosine 0
    a[4] *= 1e-10  # norms below eps: clamped like torch's
    b[4] *= 1e-10
    expected = pair_dissimilarity_torch(a, b)
    result = pair_dissimilarity_triton(a, b)
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-6)
    published = 1 - F.cosine_similarity(a.float(), b.float(), dim=-1)
    torch.testing.assert_close(expected, published, rtol=0, atol=1e-6)
    assert float(result[3]) == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rate", [0.0, 0.5, 0.9])
def test_rate_triton_equals_torch(dtype, rate):
    embeds = drifting_clip(5, 6, 40, dtype, seed=20)
    expected = prune(embeds, (5, 2, 3), EVSConfig(mode="rate", rate=rate), backend="torch")
    result = prune(embeds, (5, 2, 3), EVSConfig(mode="rate", rate=rate), backend="triton")
    assert torch.equal(result.mask, expected.mask)
    torch.testing.assert_close(result.dissimilarity, expected.dissimilarity, rtol=0, atol=1e-6)


THRESHOLD_CONFIGS = [
    EVSConfig(mode="threshold", threshold=0.3),  # fused stream kernel
    EVSConfig(mode="threshold", threshold=0.3, max_per_tubelet=3, floor=1),  # kernel + torch
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", THRESHOLD_CONFIGS, ids=lambda c: c.key())
def test_threshold_triton_equals_torch_streamed(dtype, config):
    embeds = drifting_clip(6, 6, 40, dtype, seed=21)
    pruners = {
        backend: ThresholdPruner(config, (2, 3), 40, dtype=dtype, backend=backend)
        for backend in ("torch", "triton")
    }
    later_masks = []
    for start, stop in ((0, 2), (2, 3), (3, 6)):  # tubelets per push: 2, 1, 3
        chunk = embeds[start * 6 : stop * 6]
        expected = pruners["torch"].push(chunk)
        result = pruners["triton"].push(chunk)
        assert torch.equal(result.mask, expected.mask)
        assert torch.equal(result.kept_coords, expected.kept_coords)
        torch.testing.assert_close(result.dissimilarity, expected.dissimilarity, rtol=0, atol=1e-6)
        # The kernel writes each location's last kept embedding back, bit for bit.
        assert torch.equal(pruners["triton"]._reference, pruners["torch"]._reference)
        later_masks.append(result.mask[6:] if start == 0 else result.mask)
    later = torch.cat(later_masks)
    assert 0 < int(later.sum()) < later.numel()


def test_threshold_kernel_keeps_stored_reference_when_nothing_new_is_kept():
    embeds = drifting_clip(2, 4, 16, torch.float32, seed=22)
    config = EVSConfig(mode="threshold", threshold=2.0)
    pruner = ThresholdPruner(config, (2, 2), 16, backend="triton")
    pruner.push(embeds[:4])
    result = pruner.push(embeds[4:])
    assert not bool(result.mask.any())
    assert torch.equal(pruner._reference, embeds[:4])


def test_launchers_assert_layout_and_dtype():
    a = torch.randn(4, 8)
    with pytest.raises(AssertionError, match="must be contiguous"):
        pair_dissimilarity_triton(a.t().contiguous().t(), a)
    with pytest.raises(AssertionError, match="dtype torch.float64"):
        pair_dissimilarity_triton(a.double(), a.double())
    with pytest.raises(AssertionError):
        pair_dissimilarity_triton(a, a[:3])


def test_auto_backend_uses_torch_on_cpu():
    assert triton_kernels("auto", torch.device("cpu")) is None
    assert triton_kernels("torch", torch.device("cuda")) is None
    assert triton_kernels("triton", torch.device("cpu")) is not None


def test_package_imports_and_prunes_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from stillcut.kernels.evs import EVSConfig, prune\n"
        "from stillcut.kernels.evs.ops import triton_kernels\n"
        "assert triton_kernels('auto', torch.device('cuda')) is None\n"
        "r = prune(torch.randn(12, 4), (3, 2, 2), EVSConfig(mode='rate', rate=0.5))\n"
        "assert r.num_kept_tokens == 6\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
