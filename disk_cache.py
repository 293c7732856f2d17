"""Where stillcut keeps files it builds once, and how it publishes a folder atomically.

A cached folder is built in a private temporary folder beside its final name and moved there
with one `rename`, so readers only ever see complete folders: an interrupted build leaves no
half folder, and when two processes build the same folder at once the first rename wins and
the other discards its copy (the builds are deterministic, so both copies are equal).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """The user's stillcut cache: `$STILLCUT_CACHE`, else `$XDG_CACHE_HOME/stillcut`,
    else `~/.cache/stillcut`. Nothing is created here."""
    if explicit := os.environ.get("STILLCUT_CACHE"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "stillcut"
    return Path.home() / ".cache" / "stillcut"


def short_hash(payload: Any, length: int = 12) -> str:
    """A short, stable hex digest of a JSON-serialisable value (dict key order ignored)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@contextlib.contextmanager
def atomic_folder(final: Path, *, exist_ok: bool) -> Iterator[Path]:
    """Yield an empty temporary folder; when the block succeeds, rename it to `final`.

    With `exist_ok`, a `final` that appears meanwhile (another builder finished first) is
    kept and our copy dropped; without it, an existing non-empty `final` is an error, raised
    before any work is done. The temporary folder is removed however the block ends.
    """
    if not exist_ok and final.is_dir() and any(final.iterdir()):
        raise FileExistsError(f"{final} already exists and is not empty; pass a new folder")
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        yield partial
        partial.chmod(0o755)  # mkdtemp makes it private; the published folder should not be
        _publish(partial, final, exist_ok=exist_ok)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _publish(partial: Path, final: Path, *, exist_ok: bool) -> None:
    with contextlib.suppress(OSError):
        final.rmdir()  # only succeeds on an empty folder, which rename could not replace portably
    try:
        os.rename(partial, final)
    except OSError:
        if not (exist_ok and final.is_dir()):
            raise
