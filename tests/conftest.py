"""Shared test setup.

The Triton interpreter must be chosen before any kernel module is imported, so CPU runs can
check Triton kernels against their torch references. Built checkpoints go to a cache folder of
this test session (or the one CI names), never to the user's home cache.
"""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("STILLCUT_CACHE", tempfile.mkdtemp(prefix="stillcut-test-cache-"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.manual_seed(0)

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """A tiny random Qwen2.5-VL checkpoint with the real Qwen2.5 tokenizer (built once)."""
    from stillcut.engine.factory import cached_checkpoint

    return cached_checkpoint("tiny", seed=0)


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    return SAMPLES
