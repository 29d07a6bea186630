"""The OpenAI-compatible server (`spec-hal serve`), driven by the official `openai` client
and raw HTTP: completions and chat, streaming or not, stop strings, logprobs, seeds;
greedy output through HTTP identical to `generate`; 32 concurrent streams; malformed
input; a client that disconnects; 503 past the queue bound; live /metrics; SIGTERM.

One server on a free 127.0.0.1 port for the module (SmolLM2-135M, the first 2 layers as
the draft model, so both KV pools are exercised)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

MODEL = "smollm2-135m"
MAX_IN_FLIGHT = 40   # --max-num-seqs 8 + --max-queue-len 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    import hal
    from hal.models.fetch import fetch
    try:
        fetch(MODEL)
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    port = free_port()
    env = {**os.environ, "HAL_BACKEND": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "hal", "serve", "--model", MODEL, "--port", str(port),
                             "--draft", "self:2", "--k", "3", "--max-num-seqs", "8", "--max-queue-len", "32",
                             "--max-model-len", "512", "--cpu-budget-gib", "2", "--shutdown-timeout", "5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the server did not come up within 180 s")
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Plain greedy `generate` in this process, and the tokenizer."""
    import hal
    from hal.engine.decoder import Request, SpeculativeDecoder
    from hal.drafters.registry import load_model
    model, tok = load_model(MODEL, hal.get_backend("cpu"), "auto")   # the server's default dtype

    def run(ids, n):
        return SpeculativeDecoder(model, None, num_blocks=64).generate(
            [Request(ids, max_new_tokens=n, stop_ids=model.cfg.stop_ids)])[0]
    return run, tok


def metrics(base) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def blocks_used(base) -> dict:
    m = metrics(base)
    return {dict(k[1])["pool"]: v for k, v in m.items() if k[0] == "spec_hal:kv_blocks_used"}


def wait_all_free(base, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = blocks_used(base)
        if used and all(v == 0 for v in used.values()):
            return used
        time.sleep(0.2)
    raise AssertionError(f"KV blocks still in use: {blocks_used(base)}")


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[1] + "/health").json() == {"status": "ok"}


def test_greedy_completion_through_http_equals_generate(client, reference):
    run, tok = reference
    prompt = "The cat sat on the mat. The cat sat on the"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    want = run(tok.encode(prompt).ids, 16)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(tok.encode(prompt).ids) and r.usage.completion_tokens == len(want)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_chat_streaming_equals_generate(client, reference):
    from hal.server.openai_schema import render_chat
    run, tok = reference
    msgs = [{"role": "user", "content": "Repeat exactly: one two three four five."}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want = run(tok.encode(render_chat(msgs)).ids, 20)
    assert text == tok.decode(want, skip_special_tokens=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want)
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    assert plain.choices[0].message.content == text


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    for stream in (False, True):
        if stream:
            got = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[stop], stream=True))
        else:
            r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0,
                                          stop=[stop])
            got = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        assert got == text[:text.find(stop)], (stream, got, text, stop)


def test_logprobs_are_the_targets(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)   # greedy: the top token
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 4 and all(len(t) <= 2 for t in c.choices[0].logprobs.top_logprobs)


def test_the_same_seed_gives_the_same_text(client):
    def once(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                         top_p=0.95, seed=seed).choices[0].text
    a, b, c = once(7), once(7), once(8)
    assert a == b
    assert a != c or once(9) != a


def test_32_concurrent_streams_complete_and_free_every_block(server):
    base = server[1]

    async def one(c, i):
        text, finish = "", None
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=8 + i % 5, temperature=0 if i % 2 else 0.7, seed=i, stream=True,
            extra_body={"speculative": {"k": i % 4}})
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return text, finish

    async def run():
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(c, i) for i in range(32)))
    got = asyncio.run(run())
    assert all(f in ("stop", "length") for _, f in got) and sum(bool(t) for t, _ in got) >= 30
    assert set(wait_all_free(base)) == {"target", "draft"}


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, "body"),
    (b'{"model": "smollm2-135m", "prompt": 5}', 400, "prompt"),
    (b'{"model": "gpt-4", "prompt": "hi"}', 400, "model"),
    (b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 600}', 400, "max_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"model": "smollm2-135m", "prompt": "hi", "n": 2}', 400, "n"),
    (b'{"model": "smollm2-135m", "prompt": [1, 99999999]}', 400, None),
    (b'{"model": "smollm2-135m", "prompt": "hi", "speculative": {"k": -1}}', 400, "k"),
    (b'[1, 2]', 400, "body"),
])
def test_malformed_requests_get_400_naming_the_field(server, body, status, param):
    r = httpx.post(server[1] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    else:   # token ids out of range: the engine's check, naming prompt_ids
        assert "prompt_ids" in err["message"], err


def test_a_huge_body_is_refused_unread(server):
    r = httpx.post(server[1] + "/v1/completions", content=b"x" * (9 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_incremental_text_equals_a_whole_decode(reference):
    """Streaming deltas (each step decoding only its own tokens) add up to the whole decode,
    multi-byte characters split across tokens included."""
    from hal.server.openai_schema import TextState
    _, tok = reference
    ids = tok.encode("héllo wörld — ünïcödé ✓ 漢字 and emoji 🙂 end").ids
    for chunk in (1, 2, 3):
        st = TextState(tok, [])
        out = "".join(st.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + st.finish()
        assert out == tok.decode(ids, skip_special_tokens=True), chunk


def test_chat_messages_are_checked(server):
    r = httpx.post(server[1] + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard",
                                                                                            "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"


def test_disconnect_frees_blocks_and_the_queue_bound_answers_503(server):
    base = server[1]
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400, "temperature": 0.8,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        streams = []
        try:
            for _ in range(MAX_IN_FLIGHT):
                s = c.stream("POST", base + "/v1/completions", json=body)
                r = s.__enter__()
                assert r.status_code == 200
                streams.append((s, r))
            over = httpx.post(base + "/v1/completions", json=body, timeout=30)
            assert over.status_code == 503 and over.headers["retry-after"] == "1", over.text
            assert over.json()["error"]["type"] == "server_busy"
            next(line for line in streams[0][1].iter_lines() if line.startswith("data:"))   # it is producing
            deadline = time.monotonic() + 30
            while blocks_used(base)["target"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert blocks_used(base)["target"] > 0
        finally:
            for s, _ in streams:   # disconnect mid-stream
                s.__exit__(None, None, None)
    wait_all_free(base)
    m = metrics(base)
    assert m[("spec_hal:request_success_total", (("finished_reason", "abort"),))] >= MAX_IN_FLIGHT


def test_metrics_parse_and_move(server, client):
    base = server[1]
    before = metrics(base)
    client.completions.create(model=MODEL, prompt="a b a b a b a b", max_tokens=12, temperature=0)
    after = metrics(base)

    def val(m, name, **labels):
        return m.get((name, tuple(sorted(labels.items()))), 0.0)
    for name in ("spec_hal:spec_decode_num_drafts_total", "spec_hal:spec_decode_num_draft_tokens_total",
                 "spec_hal:generation_tokens_total", "spec_hal:e2e_request_latency_seconds_count",
                 "spec_hal:time_to_first_token_seconds_count", "spec_hal:router_k_count"):
        assert val(after, name) > val(before, name), name
    assert val(after, "spec_hal:request_success_total", finished_reason="length") + val(
        after, "spec_hal:request_success_total", finished_reason="stop") > 0
    for name in ("spec_hal:num_requests_running", "spec_hal:num_requests_waiting", "spec_hal:num_preemptions_total",
                 "spec_hal:draft_failures_total", "spec_hal:stale_drafts_total"):
        assert any(k[0] == name for k in after), name
    assert ("spec_hal:kv_blocks_free", (("pool", "draft"),)) in after


def test_sigterm_finishes_and_exits_0(server, client):
    proc, base = server
    import threading
    out = {}

    def slow():
        out["r"] = client.completions.create(model=MODEL, prompt="Tell me about the sea.", max_tokens=24,
                                             temperature=0)
    t = threading.Thread(target=slow)
    t.start()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert proc.wait(60) == 0
    assert out["r"].choices[0].finish_reason in ("length", "stop") and out["r"].usage.completion_tokens > 0
