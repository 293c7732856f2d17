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
# Results must not depend on the machine: "auto" compute dtypes see a CPU without bfloat16
# dot products (float32 products) unless a test names its flags.
os.environ.setdefault("STILLCUT_CPU_FLAGS", "")

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
def small_draft_checkpoint() -> Path:
    """A smaller Qwen2.5-VL checkpoint than `tiny` (one layer of width 24, a one-block tower of
    its own) with the tiny checkpoints' tokenizer and preprocessing: a draft model for them."""
    from stillcut.engine.factory import cached_checkpoint

    text = {"hidden_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 1, "intermediate_size": 32}
    vision = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32}
    vision["fullatt_block_indexes"] = (0,)
    return cached_checkpoint("tiny", seed=1, text=text, vision=vision)


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    return SAMPLES
