"""The pluggy hook specifications of spec-hal.

A backend is a plugin: a module (or object) with ``@hal.hookimpl`` functions,
declared as an entry point in the ``spec_hal`` group of its distribution::

    [project.entry-points.spec_hal]
    mybackend = "my_package.hal_plugin"

The built-in ``cpu``, ``cuda`` and ``ascend`` backends are declared the same way
in spec-hal's own ``pyproject.toml``. During development a plugin module can
also be named in ``HAL_PLUGINS`` (comma separated module names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:
    from hal.backend import BackendSpec

PROJECT = "spec_hal"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register: Callable[["BackendSpec"], None]) -> None:
    """Register zero or more backends.

    Called once, the first time the registry is needed (``hal.get_backend``,
    ``hal.list_backends``, ``python -m hal info``), never at import time.

    :param register: call ``register(spec)`` with a `hal.BackendSpec` for each
        backend this plugin provides. A spec is a description only: it must not
        import a device runtime or touch a device. Availability is probed later,
        lazily, through ``spec.probe``; the ops are imported through
        ``spec.load`` only when the backend is selected.
    :returns: nothing; the return value is ignored.

    Registering a name that is already registered raises `hal.HalError`.
    """
