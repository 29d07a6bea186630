"""The suite's runs do not depend on earlier ones: routers learn afresh (`hal.engine.route_memory`;
tests/engine/test_route_memory.py turns it on where it is the subject)."""

import os


def pytest_configure(config):
    os.environ.setdefault("HAL_ROUTE_MEMORY", "0")
