"""This CPU's feature flags, which pick the native kernels' dot products and the "auto"
compute dtype. They are read at run time from /proc/cpuinfo, never assumed;
`STILLCUT_CPU_FLAGS` replaces them (space-separated; empty: none), so a detection can be
forced off.
"""

from __future__ import annotations

import functools
import os

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FLAGS_VARIABLE = "STILLCUT_CPU_FLAGS"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags: `STILLCUT_CPU_FLAGS` when set, else /proc/cpuinfo's (none
    where there is no such file)."""
    forced = os.environ.get(FLAGS_VARIABLE)
    if forced is not None:
        return frozenset(forced.split())
    return _proc_cpu_flags()


@functools.cache
def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()
