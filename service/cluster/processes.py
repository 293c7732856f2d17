"""The processes a local Ray instance started, and making sure they end with it.

`ray.shutdown()` stops the raylet and the GCS it started, but the raylet's own children (the
dashboard and runtime-env agents among them) may outlive it, orphaned, and some ignore SIGTERM.
So the launcher notes every descendant of this process before it shuts Ray down and, once Ray
is down, gives those still running a grace period after SIGTERM, then SIGKILL. Linux `/proc`
only; elsewhere nothing is noted and Ray's own shutdown is all there is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROC = Path("/proc")
_POLL_S = 0.1
_WATCH_S = 0.5  # how often the watcher looks for its parent

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


def _here() -> Process:
    return (os.getpid(), _stat(os.getpid())[19])


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


def start_watcher(existing: list[Process], grace_s: float) -> subprocess.Popen:
    """A small process that notes every descendant of this one (but `existing`) while this one
    runs, and reaps them once it is gone, however it ended: Ray's native signal handler may end
    a driver on SIGTERM before any Python cleanup runs, even before the service is deployed."""
    argv = [sys.executable, "-m", __name__, json.dumps(_here()), str(grace_s), json.dumps(existing)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)


def _watch(parent: Process, grace_s: float, existing: list[Process]) -> None:
    noted: dict[Process, None] = {}  # insertion-ordered set
    while alive([parent]):
        for process in descendants(parent[0]):
            if process not in existing and process[0] != os.getpid():
                noted[process] = None
        time.sleep(_WATCH_S)
    reap(list(noted), grace_s)


if __name__ == "__main__":
    _watch(
        tuple(json.loads(sys.argv[1])),
        float(sys.argv[2]),
        [tuple(p) for p in json.loads(sys.argv[3])],
    )
