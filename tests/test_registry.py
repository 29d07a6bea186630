"""Registry and selection: entry points, HAL_PLUGINS, HAL_BACKEND, lazy probing."""

import os
import subprocess
import sys
import types

import pytest

import hal
from hal import BackendSpec, hookimpl, registry


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("HAL_BACKEND", raising=False)
    monkeypatch.delenv("HAL_PLUGINS", raising=False)
    registry.reset()
    yield
    registry.reset()


def plugin(*specs):
    mod = types.ModuleType("fake_plugin")

    @hookimpl
    def register_backends(register):
        for s in specs:
            register(s)

    mod.register_backends = register_backends
    return mod


def cpu_ops():
    import backends.cpu.ops as ops
    return ops


def test_cpu_is_registered_through_the_entry_point():
    names = [b.name for b in hal.list_backends()]
    assert "cpu" in names
    row = next(b for b in hal.list_backends() if b.name == "cpu")
    assert row.available and row.device_type == "cpu" and "oracle" in row.validation
    assert hal.get_backend("cpu").name == "cpu"


def test_unknown_backend_lists_registered(monkeypatch):
    monkeypatch.setenv("HAL_BACKEND", "nonsense")
    with pytest.raises(hal.HalError, match=r"nonsense.*registered: .*cpu \(available\)"):
        hal.get_backend()


def test_unknown_backend_from_the_shell():
    env = dict(os.environ, HAL_BACKEND="nonsense")
    r = subprocess.run([sys.executable, "-c", "import hal; hal.get_backend()"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "HalError" in r.stderr and "registered: " in r.stderr and "cpu (available)" in r.stderr


def test_explicit_unavailable_backend_raises_with_reason_and_auto_skips_it():
    hal.register_plugin(plugin(BackendSpec(name="ghost", device_type="cpu", load=cpu_ops, priority=100,
                                           probe=lambda: "no ghost device here")))
    with pytest.raises(hal.HalError, match="ghost.*unavailable: no ghost device here"):
        hal.get_backend("ghost")
    assert hal.get_backend().name == "cpu"          # auto: the unavailable higher priority is skipped
    assert hal.get_backend("auto").name == "cpu"


def test_auto_prefers_priority_and_third_party_plugins_work():
    hal.register_plugin(plugin(BackendSpec(name="fast", device_type="cpu", load=cpu_ops, priority=10)))
    be = hal.get_backend()
    assert be.name == "fast" and be.verify_greedy is not None


def test_plugin_from_env(monkeypatch, tmp_path):
    (tmp_path / "my_hal_plugin.py").write_text(
        "import hal\n"
        "@hal.hookimpl\n"
        "def register_backends(register):\n"
        "    register(hal.BackendSpec(name='mine', device_type='cpu', load=lambda: __import__('backends.cpu.ops',"
        " fromlist=['x']), probe=lambda: None))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HAL_PLUGINS", "my_hal_plugin")
    registry.reset()
    assert "mine" in [b.name for b in hal.list_backends()]


def test_bad_plugins_are_errors(monkeypatch):
    monkeypatch.setenv("HAL_PLUGINS", "no_such_module_xyz")
    registry.reset()
    with pytest.raises(hal.HalError, match="HAL_PLUGINS"):
        hal.list_backends()
    monkeypatch.delenv("HAL_PLUGINS")
    registry.reset()
    hal.register_plugin(plugin(BackendSpec(name="cpu", device_type="cpu", load=cpu_ops)))
    with pytest.raises(hal.HalError, match="registered twice"):
        hal.list_backends()


def test_probe_exception_becomes_reason():
    def boom():
        raise RuntimeError("driver exploded")
    hal.register_plugin(plugin(BackendSpec(name="flaky", device_type="cpu", load=cpu_ops, probe=boom)))
    row = next(b for b in hal.list_backends() if b.name == "flaky")
    assert not row.available and "driver exploded" in row.reason


def test_import_is_free_of_side_effects():
    code = ("import sys, hal, hal.registry as r\n"
            "assert r._pm is None and r._specs is None\n"
            "assert 'backends.cpu' not in sys.modules and 'backends.cpu.ops' not in sys.modules\n"
            "assert 'triton' not in sys.modules and 'torch_npu' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hal_check_env_turns_value_checks_on(monkeypatch):
    spec = BackendSpec(name="gpuish", device_type="cpu", load=cpu_ops, always_check_values=False)
    assert not hal.Backend(spec, cpu_ops()).check_values
    monkeypatch.setenv("HAL_CHECK", "1")
    assert hal.Backend(spec, cpu_ops()).check_values


def test_placement_resolves_plugin_devices_and_picks_the_link():
    from hal.placement import Placement, link_backend, resolve_side
    hal.register_plugin(plugin(BackendSpec(name="vendorx", device_type="cpu", load=cpu_ops, devices=("xpu",),
                                           collective="xccl"),
                               BackendSpec(name="down", device_type="cpu", load=cpu_ops, devices=("ypu",),
                                           probe=lambda: "no ypu here")))
    assert resolve_side("xpu:1").backend.name == "vendorx"          # a device type a plugin serves
    with pytest.raises(hal.HalError, match="draft: expected an available backend or device type, got 'ypu:0' "
                                           r"\(down: no ypu here\)"):
        resolve_side("ypu:0", "draft")                                 # explicit and unavailable: no fallback
    assert link_backend(Placement("xpu:0", "vendorx:1")) == "xccl"     # same collective on both ends
    assert link_backend(Placement("xpu:0", "cpu")) == "gloo"           # mixed pair
    assert link_backend(Placement("cpu", "cpu")) == "gloo"
    assert link_backend(Placement("auto", "xpu:0")) == "gloo"
