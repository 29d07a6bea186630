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
    from hal.distributed.placement import Placement, link_backend, resolve_side
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


def test_a_misspelled_hook_is_an_error_naming_plugin_and_hook(monkeypatch, tmp_path):
    (tmp_path / "typo_hal_plugin.py").write_text(
        "import hal\n@hal.hookimpl\ndef register_backend(register):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HAL_PLUGINS", "typo_hal_plugin")
    hal.registry.reset()
    try:
        with pytest.raises(hal.HalError) as e:
            hal.list_backends()
        assert "typo_hal_plugin" in str(e.value) and "register_backend" in str(e.value)
    finally:
        monkeypatch.delenv("HAL_PLUGINS")
        hal.registry.reset()
    typo = types.ModuleType("typo_object")
    typo.register_backend = hal.hookimpl(lambda register: None)
    with pytest.raises(hal.HalError, match="register_backend"):
        hal.register_plugin(typo)
    assert "cpu" in [b.name for b in hal.list_backends()]      # nothing half-registered


def test_disabled_plugins_are_not_loaded(monkeypatch):
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", "ascend, cuda")
    hal.registry.reset()
    try:
        names = [b.name for b in hal.list_backends()]
        assert "cpu" in names and "cuda" not in names and "ascend" not in names
        with pytest.raises(hal.HalError, match="registered"):
            hal.get_backend("cuda")
    finally:
        monkeypatch.delenv("HAL_DISABLE_PLUGINS")
        hal.registry.reset()
    assert "cuda" in [b.name for b in hal.list_backends()]


def test_the_pytest_plugin_is_inert_in_another_project(tmp_path):
    """A third-party project's own pytest run with spec-hal installed: its `backend` fixture is
    its own (not parametrised over our backends), and ours do not exist."""
    (tmp_path / "conftest.py").write_text("import pytest\n@pytest.fixture\ndef backend():\n    return 'theirs'\n")
    (tmp_path / "test_theirs.py").write_text(
        "def test_own_backend(backend):\n    assert backend == 'theirs'\n\n"
        "def test_no_oracle(request):\n    import pytest\n"
        "    with pytest.raises(pytest.FixtureLookupError):\n        request.getfixturevalue('oracle')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "spec-hal" in subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=tmp_path,
                                        capture_output=True, text=True, timeout=120).stdout  # the plugin is loaded


@pytest.mark.parametrize("field, value", [("draw_share", 0.0), ("draw_share", 1.5), ("draw_share", float("nan")),
                                          ("fuzz_examples", 0), ("fuzz_examples", -3), ("fuzz_examples", 2.5),
                                          ("head_dim_align", 0), ("name", ""), ("device_type", None)])
def test_a_plugin_spec_with_a_bad_field_is_refused_naming_it(field, value):
    """A third party's `BackendSpec` is checked where it is made: a draw share outside (0, 1]
    (a sampling test of no draws proves nothing), no fuzz examples, a zero alignment."""
    with pytest.raises(hal.HalError, match=f"{field}: expected") as e:
        BackendSpec(**{"name": "bad", "device_type": "cpu", "load": cpu_ops, field: value})
    assert e.value.arg == field
    assert BackendSpec(name="fine", device_type="cpu", load=cpu_ops, draw_share=0.05, fuzz_examples=1).draw_share == 0.05
