"""Backend registry: plugins (entry points + ``HAL_PLUGINS``), probes, selection.

Nothing here runs at import time: the plugin manager is built on first use.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import pluggy

from hal import hookspecs
from hal.backend import Backend, BackendSpec
from hal.errors import HalError

_pm: pluggy.PluginManager | None = None
_specs: dict[str, BackendSpec] | None = None
_probes: dict[str, str | None] = {}
_loaded: dict[str, Backend] = {}


@dataclass(frozen=True)
class BackendStatus:
    """One row of `list_backends`."""

    name: str
    available: bool
    reason: str | None
    device_type: str
    block_sizes: str
    head_dim_align: int
    validation: str
    priority: int


def _names(var: str) -> list[str]:
    return [m.strip() for m in os.environ.get(var, "").split(",") if m.strip()]


def disabled_plugins() -> list[str]:
    """``HAL_DISABLE_PLUGINS``: entry-point (or ``HAL_PLUGINS`` module) names never loaded."""
    return _names("HAL_DISABLE_PLUGINS")


def _check_hooks(pm: pluggy.PluginManager) -> None:
    """A misspelled hook is an error naming the plugin and the hook, not a silent no-op."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        name = pm.get_name(e.plugin) or repr(e.plugin)
        raise HalError(f"plugin {name}: expected only spec-hal hooks ({', '.join(sorted(pm.hook.__dict__))}), "
                       f"got {e}", arg="plugin", expected="spec-hal hooks", got=str(e)) from None


def plugin_manager() -> pluggy.PluginManager:
    """The plugin manager: entry points of group ``spec_hal`` and ``HAL_PLUGINS`` modules,
    less ``HAL_DISABLE_PLUGINS``; every hook checked against the hookspecs."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        for name in disabled_plugins():
            pm.set_blocked(name)
        # pluggy's own loader: the importlib one where this pluggy has it (its setuptools name is a legacy alias)
        load = getattr(pm, "load_importlib_entrypoints", None) or pm.load_setuptools_entrypoints
        load(hookspecs.PROJECT)
        for mod in _names("HAL_PLUGINS"):
            if pm.is_blocked(mod):
                continue
            try:
                module = importlib.import_module(mod)
            except ImportError as e:
                raise HalError(f"HAL_PLUGINS: expected importable module names, got {mod!r} ({e})") from e
            if not pm.is_registered(module):
                pm.register(module, name=mod)
        _check_hooks(pm)
        _pm = pm
    return _pm


def register_plugin(plugin: object) -> None:
    """Register a plugin object at run time (same hooks as an entry point); a misspelled hook
    is refused with nothing registered."""
    pm = plugin_manager()
    pm.register(plugin)
    try:
        _check_hooks(pm)
    except HalError:
        pm.unregister(plugin)
        raise
    reset(keep_plugins=True)


def reset(keep_plugins: bool = False) -> None:
    """Forget registered specs, probes and loaded backends (tests, re-configuration)."""
    global _pm, _specs
    if not keep_plugins:
        _pm = None
    _specs = None
    _probes.clear()
    _loaded.clear()


def specs() -> dict[str, BackendSpec]:
    """All registered backend specs by name."""
    global _specs
    if _specs is None:
        found: dict[str, BackendSpec] = {}

        def register(spec: BackendSpec) -> None:
            if not isinstance(spec, BackendSpec):
                raise HalError(f"register: expected a hal.BackendSpec, got {type(spec).__name__}")
            if spec.name in found:
                raise HalError(f"register: backend name {spec.name!r} is registered twice")
            found[spec.name] = spec

        plugin_manager().hook.register_backends(register=register)
        _specs = found
    return _specs


def probe(name: str) -> str | None:
    """``None`` if backend ``name`` can run here, else why not (cached)."""
    if name not in _probes:
        try:
            _probes[name] = specs()[name].probe()
        except Exception as e:  # a probe must never take the registry down
            _probes[name] = f"probe failed: {type(e).__name__}: {e}"
    return _probes[name]


def list_backends() -> list[BackendStatus]:
    """Every registered backend, highest priority first, with availability."""
    rows = []
    for s in sorted(specs().values(), key=lambda s: (-s.priority, s.name)):
        why = probe(s.name)
        rows.append(BackendStatus(s.name, why is None, why, s.device_type, str(s.block_sizes),
                                  s.head_dim_align, s.validation, s.priority))
    return rows


def _describe() -> str:
    return ", ".join(f"{r.name} ({'available' if r.available else 'unavailable: ' + str(r.reason)})"
                     for r in list_backends()) or "none"


def get_backend(name: str | None = None) -> Backend:
    """The backend ``name``, else ``$HAL_BACKEND``, else (``auto``/unset) the first
    available by priority. An explicit name that is unknown or unavailable raises
    `HalError` listing the registered backends; auto-selection skips quietly."""
    source = "name"
    if name is None:
        name, source = os.environ.get("HAL_BACKEND", "auto").strip() or "auto", "HAL_BACKEND"
    if name == "auto":
        for row in list_backends():
            if row.available:
                return _load(row.name)
        raise HalError(f"{source}: expected a backend, but none is available; registered: {_describe()}")
    if name not in specs():
        raise HalError(f"{source}: expected one of the registered backends, got {name!r}; "
                       f"registered: {_describe()}")
    why = probe(name)
    if why is not None:
        raise HalError(f"{source}: backend {name!r} was requested but is unavailable: {why}; "
                       f"registered: {_describe()}")
    return _load(name)


def _load(name: str) -> Backend:
    if name not in _loaded:
        spec = specs()[name]
        _loaded[name] = Backend(spec, spec.load())
    return _loaded[name]
