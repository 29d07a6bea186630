"""Meta-tests: the spec is documented, every op is implemented with the contract's
signature, lines up file for file, and is covered by the conformance suite."""

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import hal
import hal.conformance
from hal import hookspecs
from hal.ops import OP_FILES, OP_NAMES, Ops

ROOT = Path(__file__).resolve().parents[1]


def test_every_hookspec_is_documented():
    specs = [f for f in vars(hookspecs).values() if callable(f) and hasattr(f, f"{hookspecs.PROJECT}_spec")]
    assert specs, "no hookspecs found"
    for f in specs:
        doc = inspect.getdoc(f) or ""
        assert len(doc) > 80, f"hookspec {f.__name__} is undocumented"
        for p in inspect.signature(f).parameters:
            assert f":param {p}:" in doc, f"hookspec {f.__name__}: parameter {p} undocumented"
        assert ":returns:" in doc and "Called" in doc, f"hookspec {f.__name__}: say what it returns and when it is called"


def test_every_hookspec_is_exercised_by_a_test():
    specs = [n for n, f in vars(hookspecs).items() if callable(f) and hasattr(f, f"{hookspecs.PROJECT}_spec")]
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in specs:
        assert f"def {name}(" in tests, f"hookspec {name}: no test implements it"


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_op_is_documented(op):
    doc = inspect.getdoc(getattr(Ops, op)) or ""
    conventions = inspect.getdoc(importlib.import_module("hal.ops")) or ""
    assert len(doc) > 100, f"Ops.{op} is undocumented"
    assert ":returns:" in doc or "in place" in doc, f"Ops.{op}: document the result"
    for p in list(inspect.signature(getattr(Ops, op)).parameters)[1:]:
        assert f"``{p}``" in doc or f":param {p}:" in doc or f"``{p}``" in conventions, \
            f"Ops.{op}: parameter {p} is documented neither on the op nor in the conventions"


def _conformance_ops() -> set:
    covered = set()
    for m in pkgutil.iter_modules(hal.conformance.__path__):
        if not m.name.startswith("test_"):
            continue
        mod = importlib.import_module(f"hal.conformance.{m.name}")
        marks = getattr(mod, "pytestmark", [])
        marks = marks if isinstance(marks, list) else [marks]
        tests = [f for n, f in vars(mod).items() if n.startswith("test_") and callable(f)]
        for mark in marks:
            mark = getattr(mark, "mark", mark)
            if mark.name == "hal_op" and tests:
                covered.update(mark.args)
        for f in tests:
            for mark in getattr(f, "pytestmark", []):
                if mark.name == "hal_op":
                    covered.update(mark.args)
    return covered


def test_every_op_has_conformance_tests():
    missing = set(OP_NAMES) - _conformance_ops()
    assert not missing, f"ops without conformance tests: {sorted(missing)}"


def test_builtin_backends_implement_every_op_with_the_contract_signature():
    for spec in hal.registry.specs().values():
        if spec.name not in ("cpu", "cuda", "ascend") or hal.registry.probe(spec.name):
            continue
        impl = spec.load()
        for op in OP_NAMES:
            fn = getattr(impl, op)
            want = list(inspect.signature(getattr(Ops, op)).parameters)[1:]
            if isinstance(fn, torch._library.custom_ops.CustomOpDef):   # a torch.library op: its schema's names
                got = [a.name for a in fn._opoverload._schema.arguments]
            else:
                got = list(inspect.signature(fn).parameters)
            assert got == want, f"{spec.name}.{op}: signature differs"


def test_op_files_line_up():
    """verify_ops/ and every backend folder use the same file and function names."""
    for folder in ["verify_ops"] + [f"backends/{b}" for b in ("cuda", "ascend") if (ROOT / "backends" / b).exists()]:
        for op, fname in OP_FILES.items():
            path = ROOT / folder / f"{fname}.py"
            assert path.exists(), f"{folder}: {fname}.py is missing"
            assert f"def {op}(" in path.read_text(), f"{path}: no function {op}"


def test_library_code_never_imports_the_cli():
    """hal.cli is a front end: library modules import what they share from hal.drafters.kinds."""
    import re
    root = Path(__file__).resolve().parents[1] / "hal"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name not in ("cli.py", "__main__.py") and re.search(r"^\s*(from hal\.cli import|import hal\.cli|from hal import cli)",
                                                                        p.read_text(), re.M)]
    assert not offenders, f"library modules import the CLI: {offenders}"


def test_one_draft_grammar():
    import hal
    from hal.drafters.kinds import DraftSpec, parse_draft
    assert parse_draft("self:8") == DraftSpec("self", 8) and parse_draft("self") == DraftSpec("self")
    assert parse_draft("model:/m.gguf") == DraftSpec("model", path="/m.gguf") and parse_draft("none").kind == "none"
    assert parse_draft("eagle") == DraftSpec("eagle") and parse_draft("eagle:/h") == DraftSpec("eagle", path="/h")
    assert parse_draft("ngram+eagle") == DraftSpec("ngram+eagle")
    assert parse_draft("eagle-tree:/h") == DraftSpec("eagle-tree", path="/h")
    assert parse_draft("ngram-tree") == DraftSpec("ngram-tree") and parse_draft("ngram+eagle-tree").kind == "ngram+eagle-tree"
    for bad in ("self:0", "self:x", "model:", "eagles", "ngram:3", "ngram+self", "", "ngram-tree:3", "tree"):
        with pytest.raises(hal.HalError) as e:
            parse_draft(bad)
        assert e.value.arg == "--draft"
    with pytest.raises(hal.HalError, match="ngram, self\\[:L\\] or|ngram, self\\[:L\\], model"):
        parse_draft("none", ("ngram", "self", "model"))


def test_prob_values_names_the_real_row_sum():
    """A row of zeros sums to 0 (it once said 2.0: 1 + |sum - 1|)."""
    from hal.checks import prob_values
    with pytest.raises(hal.HalError, match="row 0 sums to 0.0"):
        prob_values("x", torch.zeros(1, 4))
    with pytest.raises(hal.HalError, match="row 1 sums to 2.0"):
        prob_values("x", torch.tensor([[0.5, 0.5], [1.0, 1.0]]))
