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


def test_bench_prints_prometheus_metrics():
    r = run("bench", "--max-tokens", "8", "--k", "4", HAL_BACKEND="cpu")
    if "model not fetchable" in r.stderr or "could not be downloaded" in r.stderr:
        import pytest
        pytest.skip(r.stderr[-300:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tok/s" in r.stdout and "TTFT P50" in r.stdout
    for name in ("spec_hal_acceptance_by_position", "spec_hal_acceptance_length_bucket",
                 "spec_hal_time_to_first_token_seconds_count 2.0", "spec_hal_time_per_output_token_seconds_bucket",
                 'spec_hal_latency_quantile_seconds{metric="e2e_request_latency",quantile="0.99"}'):
        assert name in r.stdout, name
