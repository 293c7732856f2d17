"""The C structs of the native decode step and their ctypes mirrors (`kernels.cpu.structs`) lay
out alike: a program compiled from `decode.c` prints each struct's size and every field's
offset and size, which must equal the mirror's. A mirror that drifted from its struct would
hand the kernel fields at the wrong offsets: a crash, or a model silently wrong.

Where there is no C compiler the test skips, except where `STILLCUT_REQUIRE_NATIVE_DECODE` is
set (as CI sets it).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from stillcut.kernels.cpu import library, structs

# struct name in C -> its mirror: every ctypes struct in `structs`, named `_<C name>`
MIRRORS = {
    name.removeprefix("_"): value
    for name, value in vars(structs).items()
    if isinstance(value, type) and issubclass(value, ctypes.Structure)
}


def _compiler() -> str:
    compiler = library.c_compiler()
    if shutil.which(compiler) is None:
        if os.environ.get("STILLCUT_REQUIRE_NATIVE_DECODE"):
            pytest.fail(f"no C compiler ({compiler}) to build the layout program")
        pytest.skip(f"no C compiler ({compiler})")
    return compiler


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, int]:
    """`{"Struct": sizeof, "Struct.field": offset, "Struct.field/size": size}` as C lays them
    out, for every mirrored struct and field."""
    folder = tmp_path_factory.mktemp("layout")
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "decode.c"', "int main(void) {"]
    for name, mirror in MIRRORS.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in mirror._fields_:
            member = structs.C_NAMES.get(field, field)
            lines.append(
                f'    printf("{name}.{field} %zu\\n{name}.{field}/size %zu\\n", '
                f"offsetof({name}, {member}), sizeof((({name} *)0)->{member}));"
            )
    lines += ["    return 0;", "}"]
    program = folder / "layout.c"
    program.write_text("\n".join(lines) + "\n")
    flags = ("-O0", "-march=native", "-fopenmp", "-std=gnu11", f"-I{library.HERE}")
    built = subprocess.run(
        [_compiler(), *flags, "-o", str(folder / "layout"), str(program), "-lm"],
        capture_output=True,
        text=True,
        timeout=library.COMPILE_TIMEOUT_S,
    )
    assert built.returncode == 0, built.stderr
    printed = subprocess.run([str(folder / "layout")], capture_output=True, text=True, check=True)
    return {
        key: int(value) for key, value in (line.split() for line in printed.stdout.splitlines())
    }


def mismatches(name: str, mirror: type[ctypes.Structure], layout: dict[str, int]) -> list[str]:
    """Where `mirror` and C's struct `name` differ: its size, a field's offset or size."""
    found = []
    if ctypes.sizeof(mirror) != layout[name]:
        found.append(f"{name}: {ctypes.sizeof(mirror)} bytes in ctypes, {layout[name]} in C")
    for field, _ in mirror._fields_:
        described = getattr(mirror, field)
        at, size = layout[f"{name}.{field}"], layout[f"{name}.{field}/size"]
        if (described.offset, described.size) != (at, size):
            found.append(
                f"{name}.{field}: offset {described.offset} size {described.size} in ctypes, "
                f"offset {at} size {size} in C"
            )
    return found


def test_every_struct_the_kernel_reads_is_mirrored():
    assert set(MIRRORS) == {
        "Matrix",
        "Attention",
        "GatedMlp",
        "Mlp",
        "Moe",
        "SoftmaxMoe",
        "Mamba2",
        "GatedDelta",
        "Block",
        "Embedding",
        "Model",
        "Step",
    }


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_each_mirror_matches_its_c_struct(c_layout, name):
    assert mismatches(name, MIRRORS[name], c_layout) == []


def test_a_planted_field_reorder_is_caught(c_layout):
    """Two fields of `Attention`'s mirror swapped (`scale` and `soft_cap`: both floats, the
    struct's size unchanged): the comparison names both."""
    fields = list(structs._Attention._fields_)
    first = next(i for i, (field, _) in enumerate(fields) if field == "scale")
    fields[first], fields[first + 1] = fields[first + 1], fields[first]
    reordered = type("_Attention", (ctypes.Structure,), {"_fields_": fields})
    assert ctypes.sizeof(reordered) == ctypes.sizeof(structs._Attention)
    found = mismatches("Attention", reordered, c_layout)
    assert len(found) == 2 and {"Attention.scale", "Attention.soft_cap"} == {
        line.split(":")[0] for line in found
    }, found


def test_a_planted_wider_field_is_caught(c_layout):
    """`Matrix.format` widened to 64 bits in the mirror: every field after it moves."""
    fields = [
        (field, ctypes.c_int64 if field == "format" else kind)
        for field, kind in structs._Matrix._fields_
    ]
    widened = type("_Matrix", (ctypes.Structure,), {"_fields_": fields})
    found = mismatches("Matrix", widened, c_layout)
    assert any(line.startswith("Matrix.format:") for line in found)
    assert any(line.startswith("Matrix.packed:") for line in found)
