"""The conformance suite's fixtures: ``backend`` (parametrised over ``--hal-backend``, default
every available backend) and ``oracle``. A conftest, not the pytest11 plugin, so that a
project with spec-hal installed sees no extra fixtures or parametrisation."""

from __future__ import annotations

import pytest


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
