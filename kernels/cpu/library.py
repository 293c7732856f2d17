"""The native CPU kernels' libraries: each C file compiled on first use with the system C
compiler (`$CC`, else `cc`) into the stillcut cache, keyed by the sources (with the headers they
include), the compiler and the CPU. They link libgomp, the OpenMP runtime torch's Linux wheels
have already loaded under the same name, so both share one thread pool. Without a compiler, or
with `STILLCUT_NATIVE_DECODE=0`, `load()` returns None and the models run their torch ops
instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from stillcut.disk_cache import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCE = HERE / "decode.c"
HEADERS = tuple(sorted(HERE.glob("*.h")))  # every header `decode.c` may include
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
ENABLE_VARIABLE = "STILLCUT_NATIVE_DECODE"
COMPILE_TIMEOUT_S = 120


def enabled() -> bool:
    """False when `STILLCUT_NATIVE_DECODE` is set to 0 (the torch ops then run instead)."""
    return os.environ.get(ENABLE_VARIABLE, "1") != "0"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built once per source, compiler and CPU; None (logged
    once) when it cannot be built here."""
    if not enabled():
        return None
    library = compiled(SOURCE, HEADERS, "the native CPU decode step", "about 30 s")
    if library is None:
        return None
    library.decode_step.restype = library.check_model.restype = ctypes.c_int
    library.matmul.restype = ctypes.c_int
    # declared, so that the per-step calls pass plain ints as addresses (no wrapper objects)
    address = ctypes.c_void_p
    library.decode_step.argtypes = [
        address,
        address,
        ctypes.c_int,
        address,
        address,
        address,
        address,
    ]
    library.matmul.argtypes = [
        address,
        address,
        ctypes.c_int64,
        ctypes.c_int,
        address,
        address,
        address,
        ctypes.c_int,
    ]
    library.scratch_floats.restype = ctypes.c_int64
    return library


def c_compiler() -> str:
    """The C compiler the libraries are built with: `$CC`, else `cc`."""
    return os.environ.get("CC", "cc")


def compiled(source: Path, headers: Sequence[Path], what: str, duration: str) -> ctypes.CDLL | None:
    """`source` (including `headers`) compiled for this machine into the stillcut cache, once
    per source, compiler and CPU, and loaded; None (logged) when it cannot be built here.
    `what` and `duration` are what the first compile says on stderr."""
    compiler = c_compiler()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        sources = (path.read_text() for path in (source, *headers))
        key = hashlib.sha256(
            "\0".join((*sources, compiler, version, *FLAGS, _cpu())).encode()
        ).hexdigest()[:16]
        target = cache_dir() / "native" / f"{source.stem}-{key}.so"
        if not target.exists():
            # the first run sits silent for tens of seconds otherwise
            print(
                f"stillcut: compiling {what} for this machine, once "
                f"({duration}; kept in {target.parent})...",
                file=sys.stderr,
                flush=True,
            )
            started = time.perf_counter()
            _compile(compiler, source, target)
            log.info("compiled %s in %.1f s", what, time.perf_counter() - started)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("%s unavailable, using torch ops: %s", what, detail)
        return None


def _compile(compiler: str, source: Path, target: Path) -> None:
    """Compile into a private file beside `target`, then rename: readers never see half a
    library, and two processes compiling at once both end with a whole one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, str(source), "-lm"],
            capture_output=True,
            text=True,
            check=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _cpu() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in info if line.startswith(wanted)}))
