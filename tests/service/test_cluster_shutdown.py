"""`stillcut serve --replicas 2` stopped with SIGTERM leaves nothing behind: every process the
local Ray instance started (the raylet's dashboard and runtime-env agents included, which may
outlive it) is gone within 30 s, three runs in a row (one run in three used to leave orphans).
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stillcut.service.cluster.processes import alive, descendants, reap
from stillcut.service.server import wait_until_serving

NUM_RUNS = 3
GONE_WITHIN_S = 30.0
START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(checkpoint, port: int, log) -> subprocess.Popen:
    argv = [
        *(sys.executable, "-m", "stillcut.service.cli", "serve", "--replicas", "2"),
        *("--model", str(checkpoint), "--port", str(port), "--num-cpus-per-replica", "0.5"),
        *("--kv-cache-memory", "16", "--max-model-len", "1024"),
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finding the processes needs /proc")
def test_sigterm_ends_every_process_the_cluster_started(tiny_checkpoint, tmp_path):
    for run in range(NUM_RUNS):
        with open(tmp_path / f"serve-{run}.log", "w") as log:
            port = _free_port()
            server = _serve(tiny_checkpoint, port, log)
            started = []
            try:
                wait_until_serving(f"http://127.0.0.1:{port}", server, START_TIMEOUT_S)
                started = descendants(server.pid)
                commands = [_command(pid) for pid, _ in started]
                assert any("agent" in command.lower() for command in commands), commands
                stopped_at = time.monotonic()
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=GONE_WITHIN_S)
                while alive(started) and time.monotonic() - stopped_at < GONE_WITHIN_S:
                    time.sleep(0.2)
                left = [(pid, _command(pid)) for pid, _ in alive(started)]
            finally:
                if server.poll() is None:
                    server.kill()
                for pid, _ in alive(started):  # never leave them to the next test
                    os.kill(pid, signal.SIGKILL)
        assert not left, (run, left, (tmp_path / f"serve-{run}.log").read_text()[-2000:])


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finding the processes needs /proc")
def test_reap_kills_an_orphan_that_ignores_sigterm():
    """The mechanism on its own: a grandchild that ignores SIGTERM and whose parent is gone."""
    parent = subprocess.Popen(
        ["sh", "-c", "(trap '' TERM; exec sleep 60) & echo $!; wait"], stdout=subprocess.PIPE
    )
    orphan_pid = int(parent.stdout.readline())
    started = descendants(os.getpid())
    assert orphan_pid in [pid for pid, _ in started]
    parent.kill()
    parent.wait()
    parent.stdout.close()
    mine = [p for p in started if p[0] == orphan_pid]
    assert alive(mine)  # orphaned, and SIGTERM alone does not end it
    assert reap(mine, grace_s=0.5) == mine
    deadline = time.monotonic() + 5
    while alive(mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(mine)
