"""The processes a local Ray instance started, and making sure they end with it.

`ray.shutdown()` stops the raylet and the GCS it started, but the raylet's own children (the
dashboard and runtime-env agents among them) may outlive it, orphaned, and some ignore SIGTERM.
So the launcher notes every descendant of this process before it shuts Ray down and, once Ray
is down, gives those still running a grace period after SIGTERM, then SIGKILL. Linux `/proc`
only; elsewhere nothing is noted and Ray's own shutdown is all there is.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

PROC = Path("/proc")
_POLL_S = 0.1

Process = tuple[int, str]  # (pid, start time in clock ticks): a pid is reused, this pair is not


def descendants(pid: int) -> list[Process]:
    """Every running descendant of `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is not None:
            children.setdefault(int(stat[1]), []).append(int(entry.name))
            started[int(entry.name)] = stat[19]
    found, stack = [], list(children.get(pid, ()))
    while stack:
        child = stack.pop()
        found.append((child, started[child]))
        stack.extend(children.get(child, ()))
    return found


def reap(processes: list[Process], grace_s: float) -> list[Process]:
    """SIGTERM what is left of `processes`, SIGKILL what outlives `grace_s`; those that were
    still running at the end of the grace period (now killed)."""
    _signal(alive(processes), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    _signal(left, signal.SIGKILL)
    return left


def alive(processes: list[Process]) -> list[Process]:
    """Those of `processes` still running (a zombie has ended)."""
    running = []
    for pid, start in processes:
        stat = _stat(pid)
        if stat is not None and stat[19] == start and stat[0] != "Z":
            running.append((pid, start))
    return running


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command: [state, ppid, ..., starttime at 19]."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:  # gone, or not ours to read
        return None
    return text.rpartition(")")[2].split()


def _signal(processes: list[Process], signum: int) -> None:
    for pid, _ in processes:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
