"""pytest plugin (entry point ``pytest11``): the ``--hal-backend`` option and the
``backend`` fixture, parametrised over the selected backends."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("spec-hal")
    group.addoption("--hal-backend", default=None,
                    help="comma separated backends for the conformance suite (default: every available backend)")


def pytest_configure(config):
    config.addinivalue_line("markers", "hal_op(*names): the contract ops a conformance test covers")


def _selected(config) -> list[str]:
    opt = config.getoption("--hal-backend")
    if opt:
        return [n.strip() for n in opt.split(",") if n.strip()]
    import hal
    return [b.name for b in hal.list_backends() if b.available]


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend_name", _selected(metafunc.config), scope="session")


@pytest.fixture(scope="session")
def backend(backend_name):
    """The backend under test (explicitly requested: unavailable is an error, not a skip)."""
    import hal
    return hal.get_backend(backend_name)


@pytest.fixture(scope="session")
def oracle():
    """The reference ops (`verify_ops`) behind the same argument checks."""
    from hal.conformance._helpers import oracle_backend
    return oracle_backend()


def pytest_terminal_summary(terminalreporter):
    """The fuzz figures (cases run, refused, equal to the oracle, exceptions, hangs), when it ran."""
    import sys
    fuzz = sys.modules.get("hal.conformance.test_fuzz")
    if fuzz is not None and fuzz.STATS["cases"]:
        terminalreporter.write_sep("-", "spec-hal fuzz")
        terminalreporter.write_line(", ".join(f"{k}: {v}" for k, v in fuzz.STATS.items()))
