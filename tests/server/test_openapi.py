"""The published schema is the validation: ``/openapi.json`` declares every request and
response body (`hal.server.request_bodies`), and schemathesis, run against it with all its
checks, finds nothing. Here: a bounded, deterministic pass (the fuzzing phase, about 100
cases, about a minute). The whole run, coverage phase included (750+ cases, about six
minutes on 2 cores): ``HAL_SCHEMATHESIS_PHASES=coverage,fuzzing pytest tests/server/test_openapi.py``.

The server: SmolLM2-135M, n-gram drafts, ``--max-model-len 24`` (so every accepted case
generates at most 23 tokens)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("schemathesis")

from tests.server.test_app import ready_server  # noqa: E402

HERE = Path(__file__).parent / "schemathesis"
EXAMPLES = int(os.environ.get("HAL_SCHEMATHESIS_EXAMPLES", "20"))
PHASES = os.environ.get("HAL_SCHEMATHESIS_PHASES", "fuzzing")


@pytest.fixture(scope="module")
def server():
    for _, base, _ in ready_server("--draft", "ngram", "--k", "3", "--no-route", "--max-num-seqs", "8", "--max-queue-len", "64",
                                   "--max-model-len", "24", "--cpu-budget-gib", "1"):
        yield base


def test_the_schema_declares_bodies_and_errors(server):
    doc = httpx.get(server + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert body["additionalProperties"] is False and "model" in body["required"]
        assert {"200", "400", "413", "503"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert doc["components"]["schemas"]["Speculative"]["properties"]["k"]["anyOf"][0]["maximum"] == 3


def test_schemathesis_finds_nothing(server):
    cmd = [str(Path(sys.executable).with_name("st")), "--config-file", str(HERE / "schemathesis.toml"), "run",
           server + "/openapi.json", "--checks", "all", "--max-examples", str(EXAMPLES),
           "--phases", PHASES, "--generation-deterministic", "--request-timeout", "120", "--workers", "1", "--no-color"]
    r = subprocess.run(cmd, cwd=HERE, env={**os.environ, "SCHEMATHESIS_HOOKS": "hooks", "PYTHONPATH": str(HERE)},
                       capture_output=True, text=True, timeout=900)
    print(r.stdout[-400:])   # the summary: cases generated, issues found
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "generated" in r.stdout and "failures" not in r.stdout.split("SUMMARY")[-1].lower(), r.stdout[-3000:]
