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
from tests.server.test_app import MODEL, free_port, metrics  # noqa: E402


def test_draft_worker_killed_mid_stream(tmp_path):
    import hal
    from hal.engine import Request, SpeculativeDecoder
    from hal.models.fetch import load_model
    from hal.models.fetch import fetch
    from hal.models.tokenizer import chat_template_of
    render_chat = chat_template_of(fetch(MODEL)).render_text   # the model's own template (its GGUF's)
    try:
        model, tok = load_model(MODEL, hal.get_backend("cpu"), "auto")   # the server's default dtype
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "HAL_BACKEND": "cpu"}
    cmd = [sys.executable, "-m", "hal.server.app", "--model", MODEL, "--draft", "ngram", "--k", "4", "--no-route", "--port",
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


def test_sigterm_under_torchrun_exits_0_without_a_traceback(tmp_path):
    """The outside trial: under torchrun, SIGTERM exited 1 with a traceback (torchrun's agent
    re-raises the signal; the draft rank ended in std::terminate). ``python -m
    hal.distributed.torchrun`` (torchrun's arguments) stops both ranks and exits 0."""
    import torch
    from hal.models.fetch import fetch
    try:
        fetch(MODEL)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"model not fetchable: {e}")
    port = free_port()
    cmd = [sys.executable, "-m", "hal.distributed.torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "hal.server.app", "--model", MODEL, "--draft", "ngram", "--no-route",
           "--port", str(port), "--max-model-len", "256", "--cpu-budget-gib", "2"]
    # the ranks at this process's thread count: the linear plan cached for it is reused
    env = {**os.environ, "HAL_BACKEND": "cpu", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    log = tmp_path / "torchrun.log"
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and "terminate called" not in text and "both ranks stopped" in text, text[-3000:]
