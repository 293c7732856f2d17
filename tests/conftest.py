"""Shared test setup.

The Triton interpreter must be chosen before any kernel module is imported, so CPU runs can
check Triton kernels against their torch references.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.manual_seed(0)
