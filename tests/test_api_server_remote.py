"""The server as the target rank with the drafter on a second rank (gloo on 127.0.0.1):
the draft worker is killed mid-stream; the stream finishes by plain decoding with the
plain-greedy text, /health says degraded, and the failure is counted in /metrics."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
from tests.test_api_server import MODEL, free_port, metrics  # noqa: E402


def test_draft_worker_killed_mid_stream(tmp_path):
    import hal
    from hal.engine.decoder import Request, SpeculativeDecoder
    from hal.drafters.registry import load_model
    from hal.server.openai_schema import render_chat
    try:
        model, tok = load_model(MODEL, hal.get_backend("cpu"), "auto")   # the server's default dtype
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "HAL_BACKEND": "cpu"}
    cmd = [sys.executable, "-m", "hal.server.app", "--model", MODEL, "--draft", "ngram", "--k", "4", "--port",
           str(port), "--max-model-len", "512", "--cpu-budget-gib", "2", "--draft-timeout", "10"]
    log = open(tmp_path / "draft.log", "w")
    draft = subprocess.Popen(cmd, env={**env, "RANK": "1", "HAL_SERVE_FAULT": "kill:2"}, stdout=log, stderr=log)
    target = subprocess.Popen(cmd, env={**env, "RANK": "0"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert target.poll() is None, target.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        msgs = [{"role": "user", "content": "Repeat exactly: red green blue, red green blue, red green blue."}]
        text = ""
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=120,
                          json={"model": MODEL, "messages": msgs, "max_tokens": 40, "temperature": 0,
                                "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (ch := json.loads(line[6:]))["choices"]:
                    text += ch["choices"][0]["delta"].get("content") or ""
        draft.wait(60)
        assert draft.returncode == -signal.SIGKILL   # the planted fault fired mid-stream
        want = SpeculativeDecoder(model, None, num_blocks=64).generate(
            [Request(tok.encode(render_chat(msgs)).ids, max_new_tokens=40)])[0]
        assert text == tok.decode(want, skip_special_tokens=True)
        h = httpx.get(base + "/health").json()
        assert h["status"] == "degraded" and "lost" in h["reason"], h
        m = metrics(base)
        assert m[("spec_hal:draft_failures_total", ())] == 1
        assert m[("spec_hal:spec_decode_num_drafts_total", ())] > 0   # it speculated before the kill
        target.send_signal(signal.SIGTERM)
        assert target.wait(60) == 0
    finally:
        for p in (draft, target):
            if p.poll() is None:
                p.kill()
