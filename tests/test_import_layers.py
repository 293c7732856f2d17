"""The package's import graph, read with `ast`: no cycle, and no arrow from a lower layer up.

Layers, lowest first (a module may import its own layer and the ones below it):

    stillcut.disk_cache  where built files are cached; imports nothing of stillcut
    stillcut.kernels     evs, attention, the native CPU decode, Triton kernels
    stillcut.engine      config, families and models, scheduler, KV cache, runner, engine
    stillcut.vision      decode, towers, the vision pipeline, long-video summaries
    stillcut.demo        the trained demo model and its synthetic task
    stillcut.service     HTTP / WebSocket service, the Python API, the CLI (`service.cli*`)
    stillcut             the package facade (`__init__`), which names `service` lazily

What counts as an import:
- `import` / `from ... import` at module level and inside functions alike. An import inside a
  function runs the first time the function does; a cycle through one only works because of
  the order things happen to be called in, so lazy imports are held to both rules.
- `if TYPE_CHECKING:` imports never run: they cannot close a cycle, so the cycle check skips
  them, but they are held to the layer rule (a lower layer does not name a higher one's types).
- "module:attribute" strings (the family registry's entries, `stillcut/__init__`'s facade) are
  names resolved at run time, not imports; the layer rule applies to them as well.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "stillcut"
LAYERS = ("disk_cache", "kernels", "engine", "vision", "demo", "service")
# The facade sits above every layer.
TOP = len(LAYERS)
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:\w+)?")


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` laid out under `root`."""
    modules = {package: root / "__init__.py"}
    for top in LAYERS:
        if (root / f"{top}.py").is_file():
            modules[f"{package}.{top}"] = root / f"{top}.py"
        for file in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else ():
            parts = file.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = file
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` (a module or `module.attribute`) lies in, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(inner) for inner in ast.walk(node))
    return ids


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: None if is_package else -1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [f"{base}.{alias.name}" for alias in node.names]


def import_edges(modules: dict[str, Path]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> kind: "runs" (module level or in a function), "typing"
    (`if TYPE_CHECKING:`) or "name" (a "module:attribute" string)."""
    edges: dict[tuple[str, str], str] = {}
    for module, file in modules.items():
        tree = ast.parse(file.read_text(), str(file))
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                kind = "typing" if id(node) in typing_only else "runs"
                names = _imported(module, file.name == "__init__.py", node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if not MODULE_NAME.fullmatch(node.value):
                    continue
                name = node.value.partition(":")[0]
                if name not in modules:  # a logger's name, a dtype's, ...
                    continue
                kind, names = "name", [name]
            else:
                continue
            for name in names:
                target = _owner(name, modules)
                if target is not None and target != module:
                    if edges.get((module, target)) != "runs":
                        edges[(module, target)] = kind
    return edges


def layer_of(module: str) -> int:
    parts = module.split(".")
    return TOP if len(parts) == 1 else LAYERS.index(parts[1])


def upward_imports(edges: dict[tuple[str, str], str]) -> list[str]:
    return sorted(
        f"{a} -> {b} ({kind})" for (a, b), kind in edges.items() if layer_of(b) > layer_of(a)
    )


def cycles(edges: dict[tuple[str, str], str]) -> list[list[str]]:
    """The strongly connected components of more than one module over imports that run
    (Tarjan's algorithm, iteratively)."""
    graph: dict[str, list[str]] = {}
    for (a, b), kind in sorted(edges.items()):
        if kind == "runs":
            graph.setdefault(a, []).append(b)
            graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(import_edges(package_modules(ROOT, PACKAGE))) == []


def test_no_layer_imports_a_higher_one():
    assert upward_imports(import_edges(package_modules(ROOT, PACKAGE))) == []


def test_the_graph_sees_the_packages_imports():
    edges = import_edges(package_modules(ROOT, PACKAGE))
    assert edges[("stillcut.engine.llm_engine", "stillcut.engine.scheduler")] == "runs"
    assert edges[("stillcut.engine.models.families", "stillcut.engine.models.qwen2_vl.entry")] == (
        "name"
    )


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return package_modules(root, "pkg")


SYNTHETIC = {
    "__init__.py": "",
    "kernels/__init__.py": "",
    "kernels/a.py": "import os\n",
    "engine/__init__.py": "",
    "engine/b.py": "from pkg.kernels import a\n",
    "engine/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
    "service/__init__.py": "",
    "service/d.py": "from ..engine.b import thing\n",
}


def test_a_clean_synthetic_package_passes(tmp_path):
    edges = import_edges(_write(tmp_path, SYNTHETIC))
    assert edges[("pkg.service.d", "pkg.engine.b")] == "runs"
    assert edges[("pkg.engine.c", "pkg.engine.b")] == "typing"
    assert cycles(edges) == [] and upward_imports(edges) == []


@pytest.mark.parametrize("where", ["module level", "in a function"])
def test_a_planted_cycle_fails(tmp_path, where):
    planted = "from pkg.engine import c\n"
    if where == "in a function":
        planted = "def load():\n    from pkg.engine import c\n"
    files = {**SYNTHETIC, "engine/b.py": SYNTHETIC["engine/b.py"] + planted}
    files["engine/c.py"] = "from pkg.engine.b import thing\n"
    assert cycles(import_edges(_write(tmp_path, files))) == [["pkg.engine.b", "pkg.engine.c"]]


@pytest.mark.parametrize(
    "planted",
    [
        "from pkg.engine.b import thing\n",
        "def load():\n    import pkg.service.d\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import c\n",
        "ENTRY = 'pkg.engine.c:THING'\n",
    ],
    ids=["module level", "in a function", "typing only", "module:attribute name"],
)
def test_a_planted_upward_import_fails(tmp_path, planted):
    edges = import_edges(_write(tmp_path, {**SYNTHETIC, "kernels/a.py": planted}))
    assert upward_imports(edges) and upward_imports(edges)[0].startswith("pkg.kernels.a -> ")
