"""stillcut: ask questions about video on hardware you own.

The repository root is this package; `vision`, `kernels`, `engine` and `service` are its
subpackages. Heavy imports stay lazy so `import stillcut.engine` never pulls in PyAV, and the
service's names below load the service (and PyAV) only when first used.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["DescribeResult", "VideoLLM", "VideoSummary", "describe_video", "summarize_video"]

_LAZY = {
    "describe_video": "stillcut.service.api",
    "summarize_video": "stillcut.service.api",
    "VideoSummary": "stillcut.vision.summary.result",
    "VideoLLM": "stillcut.service.api",
    "DescribeResult": "stillcut.service.result",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'stillcut' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
