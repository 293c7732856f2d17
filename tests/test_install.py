"""A plain (non-editable) install lays the top-level folders out as `stillcut.*` and works: a
wheel built from the tree, installed into a fresh environment, imports every built-in family
and finds the native C sources and the trained demo checkpoint."""

import json
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run by the installed package: every built-in family's entry, language model, tower, media and
# checkpoint recipe import; the C sources and the demo checkpoint are where the package says.
PROBE = """
import json, stillcut
from stillcut.demo import demo_checkpoint
from stillcut.engine.models.families import FAMILIES
from stillcut.kernels.cpu import library
families = {}
for model_type in FAMILIES.model_types:
    entry = FAMILIES.get(model_type)
    classes = (entry.language_model_class(), entry.vision_tower_class(), entry.media_class())
    entry.checkpoint_recipe()
    families[model_type] = [c.__module__ for c in classes]
print(json.dumps({
    "package": stillcut.__file__,
    "families": families,
    "c_sources": [p.name for p in library.HERE.iterdir() if p.suffix in (".c", ".h")],
    "demo": str(demo_checkpoint()),
}))
"""


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
    # every package folder of the tree ships (pyproject's list is written by hand)
    folders = {
        init.parent.relative_to(ROOT).parts
        for init in ROOT.glob("**/__init__.py")
        if init.relative_to(ROOT).parts[0] not in ("tests", "bench", "samples", "build")
        and not init.relative_to(ROOT).parts[0].startswith(".")
    }
    shipped = {tuple(name.split("/")[1:-1]) for name in names if name.endswith("/__init__.py")}
    assert folders == shipped, folders ^ shipped
    assert not any(name.startswith(("stillcut/tests/", "stillcut/bench/")) for name in names)

    # A fresh environment that sees this one's dependencies (a .pth naming its site folders:
    # their own .pth files, among them the checkout's editable install, are not run), so only
    # the wheel brings stillcut.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site_folder,) = (venv / "lib").glob("python3*/site-packages")
    (site_folder / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
         str(wheel)],
        check=True,
    )  # fmt: skip
    result = subprocess.run(
        [python, "-c", PROBE], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["package"].startswith(str(site_folder)), found["package"]
    assert set(found["families"]) == {
        "qwen2_5_vl",
        "qwen2_vl",
        "gemma3",
        "nemotron_h_omni",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
    }
    for modules in found["families"].values():
        assert all(module.startswith("stillcut.engine.models.") for module in modules), modules
    headers = {"linear.h", "kinds_dense.h", "kinds_hybrid.h", "kinds_softmax_moe.h"}
    assert {"decode.c", "gemm.c", *headers} <= set(found["c_sources"])
    demo = Path(found["demo"])
    assert str(demo).startswith(str(site_folder)) and (demo / "model.safetensors").is_file()
