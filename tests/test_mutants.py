"""Every planted mutant (tests/mutants) must make the conformance suite fail, and
the test that catches it must be the one meant to."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutants import ALL, HOST_MUTANTS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(ALL))
def test_conformance_catches_mutant(name):
    """Runs the conformance module meant to catch it (-k), stopping at the first failure."""
    env = dict(os.environ, HAL_PLUGINS="tests.mutants", TRITON_INTERPRET="1")
    env.pop("HAL_BACKEND", None)
    module = ALL[name][4].split(".py")[0]
    r = subprocess.run([sys.executable, "-m", "hal", "conformance", "--backend", f"mutant-{name}", "-x", "-rf",
                        "-k", module], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    failed = re.findall(r"^FAILED (\S+)", r.stdout, re.M)
    assert r.returncode != 0 and failed, f"mutant {name} passed the conformance suite:\n{r.stdout[-3000:]}"
    expected = ALL[name][4]
    assert expected in failed[0], f"mutant {name} was caught by {failed[0]}, expected {expected}"
    print(f"mutant {name}: caught by {failed[0]}")


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
        run(hal.get_backend("cpu"), kv=planted, n=60)
    run(hal.get_backend("cpu"), n=60)   # the real one passes the same search


@pytest.mark.parametrize("name", ["evicts-a-held-block", "writes-a-cached-block"])
def test_kv_state_machine_catches_prefix_cache_mutants(name):
    """evicts-a-held-block: an adopted block stays on the idle list, so a new block can take it;
    writes-a-cached-block: a block keeps its name while a truncated sequence rewrites it."""
    import hal
    from hal.conformance.test_kv_state import run
    from tests.mutants import mutate
    with pytest.raises(AssertionError, match="unheld blocks|read back|holders|hold their tokens|found again"):
        run(hal.get_backend("cpu"), kv=mutate(name), n=60)
