"""pytest plugin (entry point ``pytest11``): only the ``--hal-backend`` option, the
``hal_op`` marker and the fuzz figures. It is inert in any other project's test run: the
``backend`` / ``oracle`` fixtures and their parametrisation live in
``hal/conformance/conftest.py``, so they exist only for the conformance modules."""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("spec-hal")
    group.addoption("--hal-backend", default=None,
                    help="comma separated backends for the conformance suite (default: every available backend)")


def pytest_configure(config):
    config.addinivalue_line("markers", "hal_op(*names): the contract ops a conformance test covers")


def pytest_terminal_summary(terminalreporter):
    """The fuzz figures (cases run, refused, equal to the oracle, exceptions, hangs), when it ran."""
    import sys
    fuzz = sys.modules.get("hal.conformance.test_fuzz")
    if fuzz is not None and fuzz.STATS["cases"]:
        terminalreporter.write_sep("-", "spec-hal fuzz")
        terminalreporter.write_line(", ".join(f"{k}: {v}" for k, v in fuzz.STATS.items()))
