import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args, **env):
    e = dict(os.environ, **env)
    e.pop("HAL_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "hal", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=600)


def test_info_lists_backends():
    r = run("info")
    assert r.returncode == 0 and "cpu" in r.stdout and "validation" in r.stdout


def test_conformance_cli_exit_codes():
    ok = run("conformance", "--backend", "cpu", "-k", "golden")
    assert ok.returncode == 0, ok.stdout[-2000:]
    bad = run("conformance", "--backend", "nonsense")
    assert bad.returncode == 2 and "registered" in bad.stderr


def test_demo_runs():
    r = run("demo", "--ops", HAL_BACKEND="cpu")
    assert r.returncode == 0 and "accepted 2/4" in r.stdout
