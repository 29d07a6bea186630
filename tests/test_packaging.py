"""The wheel carries what the package reads at run time (issue 67, item 6): `make` installs with
``-e``, so no other test sees a non-editable install. At 8ab16ab the wheel lacked ``q4_rows.c``
and ``q4_mm.cpp``: a wheel install fell back to the Python layer loop and never built q4q8.

The wheel is built from a copy of the tracked tree (setuptools writes build/ and egg-info
beside its sources) and inspected: every file that ``hal/models`` compiles, each one those
#include, and every other tracked non-Python file of the packages is inside."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hal", "backends", "verify_ops")


def compiled_sources() -> set[str]:
    """What hal/models compiles (``Path(__file__).with_name(...)``) and what those #include, closed."""
    models = ROOT / "hal" / "models"
    names = {m for py in models.glob("*.py") for m in re.findall(r'with_name\("([^"]+\.(?:c|cpp|h))"\)', py.read_text())}
    todo = list(names)
    while todo:
        for inc in re.findall(r'#include "([^"]+)"', (models / todo.pop()).read_text()):
            if inc not in names:
                names.add(inc)
                todo.append(inc)
    return {f"hal/models/{n}" for n in names}


def test_the_wheel_carries_every_native_source_and_data_file(tmp_path):
    tracked = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip(f"not a git checkout: {tracked.stderr.strip()}")
    files = [f for f in tracked.stdout.split() if (ROOT / f).is_file()]
    src = tmp_path / "src"
    for f in files + ["pyproject.toml", "README.md"]:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("spec_hal-*.whl"))
    inside = set(zipfile.ZipFile(wheel).namelist())
    native = compiled_sources()
    assert {"hal/models/row_kernels.c", "hal/models/layer_loop.cpp", "hal/models/q4_mm.cpp",
            "hal/models/q4_rows.c"} <= native, native   # the scan finds what the loaders build
    assert native - inside == set(), f"native sources missing from the wheel: {sorted(native - inside)}"
    data = {f for f in files if not f.endswith(".py") and "/tests/" not in f}
    assert data - inside == set(), f"package files missing from the wheel: {sorted(data - inside)}"
