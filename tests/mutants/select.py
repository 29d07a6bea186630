"""A pytest plugin for running every mutant's conformance module in one session
(`tests/test_mutants.py`): ``HAL_MUTANT_PLAN`` (JSON, backend name -> ``[the conformance file
meant to catch it, the op it changes, the test id meant to catch it]``) keeps only those items (of a test parametrized by op,
only the changed op's: the others cannot see the mutant), and a backend's items after its first
failure are skipped (the one-process form of ``-x`` per mutant). Each backend's first failed test id
is written to the JSON file ``HAL_MUTANT_OUT``."""

from __future__ import annotations

import json
import os

import pytest

_failed: dict[str, str] = {}   # backend -> its first failed test id


def _plan() -> dict[str, list[str]]:
    return json.loads(os.environ.get("HAL_MUTANT_PLAN", "{}"))


def _backend(item) -> str | None:
    spec = getattr(item, "callspec", None)
    return None if spec is None else spec.params.get("backend_name")


def pytest_collection_modifyitems(config, items):
    plan = _plan()
    keep = [i for i in items if _backend(i) in plan and i.path.name == plan[_backend(i)][0]
            and i.callspec.params.get("op", plan[_backend(i)][1]) == plan[_backend(i)][1]]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    # the test meant to catch a mutant runs first (then its module's others): a mutant it
    # catches costs that test alone
    keep.sort(key=lambda i: plan[_backend(i)][2] not in i.nodeid)
    items[:] = keep


def pytest_runtest_setup(item):
    if _backend(item) in _failed:
        pytest.skip("this mutant is already caught")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _backend(item) not in _failed:
        _failed[_backend(item)] = item.nodeid
        with open(os.environ["HAL_MUTANT_OUT"], "w") as f:
            json.dump(_failed, f)
    return report
