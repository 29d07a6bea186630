"""Every planted mutant (tests/mutants) must make the conformance suite fail, and
the test that catches it must be the one meant to."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutants import ALL, HOST_MUTANTS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def caught(tmp_path_factory) -> dict[str, str]:
    """Every mutant's conformance module in one pytest process (tests/mutants/select.py keeps
    each mutant's own module and stops that mutant at its first failure): mutant -> the first
    test that failed on it."""
    plan = {f"mutant-{name}": [ALL[name][4].split("::")[0], ALL[name][1], ALL[name][4]] for name in ALL}   # file, op, test
    out = tmp_path_factory.mktemp("mutants") / "caught.json"
    env = dict(os.environ, HAL_PLUGINS="tests.mutants", TRITON_INTERPRET="1", HAL_MUTANT_PLAN=json.dumps(plan),
               HAL_MUTANT_OUT=str(out))
    env.pop("HAL_BACKEND", None)
    from importlib.metadata import entry_points
    installed = any(ep.value == "hal.conformance.plugin" for ep in entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "hal.conformance.plugin"]   # as `hal conformance` loads it
    r = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "hal.conformance", *plugin,
                        "-p", "tests.mutants.select", "--hal-backend", ",".join(plan), "-q",
                        "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    first = json.loads(out.read_text()) if out.exists() else {}
    return {**first, "__log__": r.stdout[-3000:] + r.stderr[-2000:]}


@pytest.mark.parametrize("name", list(ALL))
def test_conformance_catches_mutant(name, caught):
    """The conformance test meant to catch it fails on it (that test runs first for its mutant)."""
    failed = caught.get(f"mutant-{name}")
    assert failed is not None, f"mutant {name} passed the conformance suite:\n{caught['__log__']}"
    expected = ALL[name][4]
    assert expected in failed, f"mutant {name} was caught by {failed}, expected {expected}"
    print(f"mutant {name}: caught by {failed}")


def test_mutants_change_their_source():
    from tests.mutants import mutate
    for name in ALL:
        assert callable(mutate(name))
    for name in HOST_MUTANTS:
        assert mutate(name) is not None


def test_kv_state_machine_catches_a_non_atomic_reserve():
    """The planted allocator takes copy-on-write blocks before it knows the pool can give them all."""
    import hal
    from hal.conformance.test_kv_state import run
    from tests.mutants import mutate
    planted = mutate("non-atomic-reserve")
    with pytest.raises(AssertionError, match="changed the allocator|read back"):
        run(hal.get_backend("cpu"), kv=planted, n=60, shrink=False)
    run(hal.get_backend("cpu"), n=60)   # the real one passes the same search


@pytest.mark.parametrize("name", ["evicts-a-held-block", "writes-a-cached-block"])
def test_kv_state_machine_catches_prefix_cache_mutants(name):
    """evicts-a-held-block: an adopted block stays on the idle list, so a new block can take it;
    writes-a-cached-block: a block keeps its name while a truncated sequence rewrites it."""
    import hal
    from hal.conformance.test_kv_state import run
    from tests.mutants import mutate
    with pytest.raises(AssertionError, match="unheld blocks|read back|holders|hold (its|their) tokens|found again"):
        run(hal.get_backend("cpu"), kv=mutate(name), n=60, shrink=False)
