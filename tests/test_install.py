"""A plain (non-editable) install lays the top-level folders out as `stillcut.*` and works."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_the_folders_as_one_stillcut_namespace(tmp_path):
    # Build from a copy: setuptools writes build/ and egg-info beside the sources.
    source = tmp_path / "source"
    junk = (".git", ".venv", ".cache", "build", "*.egg-info", "__pycache__", "bench", "samples")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*junk))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "dist")],
        check=True,
        cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("stillcut-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {name.split("/")[0] for name in names if name.endswith(".py")}
    assert packages == {"stillcut"}, packages  # never bare `vision`, `engine`, ...
    for module in ("vision/decode.py", "kernels/evs/__init__.py", "engine/models/qwen2.py",
                   "service/cli.py", "__init__.py", "kernels/cpu_decode.c"):  # fmt: skip
        assert f"stillcut/{module}" in names
    assert not any(name.startswith(("stillcut/tests/", "stillcut/bench/")) for name in names)

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)],
        check=True,
    )  # fmt: skip
    probe = (
        "import stillcut, stillcut.vision.decode, stillcut.engine.llm_engine, "
        "stillcut.kernels.evs, stillcut.service.cli; print(stillcut.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert result.stdout.strip().startswith(str(site))
