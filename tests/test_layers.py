"""The layer direction of `hal/` (contract -> backends/reference -> models -> engine ->
drafters -> distributed -> server -> CLI) and the absence of import cycles, checked by
import-linter with the contracts in pyproject.toml; a planted upward import must break it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (the test extra has it)")


def lint(where: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=where, capture_output=True, text=True, timeout=300)


def copy_tree(dst: Path) -> Path:
    for name in ("hal", "backends", "verify_ops"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "heads"))
    shutil.copy(ROOT / "pyproject.toml", dst)
    return dst


def test_the_tree_keeps_its_layers():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout and r.stdout.count("KEPT") == 2


@pytest.mark.parametrize("module, line, names", [
    ("hal/engine/requests.py", "from hal.server import app", "hal.engine.requests -> hal.server.app"),
    ("hal/ops.py", "from hal.engine import decoder", "hal.ops -> hal.engine.decoder"),
    ("hal/models/llama.py", "from hal.drafters import kinds", "hal.models.llama -> hal.drafters.kinds"),
])
def test_a_planted_upward_import_breaks_it(tmp_path, module, line, names):
    tree = copy_tree(tmp_path)
    with open(tree / module, "a") as f:
        f.write(f"\n{line}  # planted\n")
    r = lint(tree)
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout
    assert names in r.stdout, r.stdout


def test_a_planted_cycle_breaks_it(tmp_path):
    tree = copy_tree(tmp_path)
    with open(tree / "hal/engine/requests.py", "a") as f:   # requests <- decoder already: a cycle
        f.write("\n\ndef _planted():\n    from hal.engine import decoder  # noqa: F401\n")
    r = lint(tree)
    assert r.returncode != 0 and "No cycles are allowed in hal.engine" in r.stdout, r.stdout


def test_every_module_has_a_layer():
    """A new top-level module or subpackage of hal/ must be placed in the contract."""
    import tomllib
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {m.strip() for layer in layers for m in layer.replace(":", "|").split("|")}
    tops = {f"hal.{p.stem}" for p in (ROOT / "hal").glob("*.py") if p.stem not in ("__init__", "__main__")}
    tops |= {f"hal.{p.parent.name}" for p in (ROOT / "hal").glob("*/__init__.py")}
    assert not tops - named, f"modules without a layer in pyproject.toml: {sorted(tops - named)}"
