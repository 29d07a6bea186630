"""The OpenAI-compatible server (`spec-hal serve`), driven by the official `openai` client
and raw HTTP: completions and chat, streaming or not, stop strings, logprobs, seeds;
greedy output through HTTP identical to `generate`; 32 concurrent streams; malformed
input; a client that disconnects; 503 past the queue bound; live /metrics; SIGTERM.

One server on a free 127.0.0.1 port for the module (SmolLM2-135M, the first 2 layers as
the draft model, so both KV pools are exercised)."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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


def start_server(*extra: str, port: int | None = None, log=None):
    """``spec-hal serve`` on 127.0.0.1 with its log in a file (a pipe nobody reads would
    fill and stall the server); returns (process, base URL, log path)."""
    port = free_port() if port is None else port
    log = log or tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "hal", "serve", "--model", MODEL, "--port", str(port), *extra],
                            env={**os.environ, "HAL_BACKEND": "cpu"}, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}", log.name


LOADING: dict[str, list] = {}   # base URL -> what /health answered once the log said "listening on"


def wait_ready(proc, base: str, log: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    seen = LOADING.setdefault(base, [])
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}):\n{open(log).read()}")
        listening = "listening on" in open(log).read()
        try:
            r = httpx.get(base + "/health", timeout=5)
            if listening:
                seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                return
        except httpx.HTTPError as e:
            if listening:
                seen.append((None, type(e).__name__))
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the server did not come up within {timeout} s:\n{open(log).read()}")


def ready_server(*extra: str):
    """A started, healthy server with ``extra`` flags (skips when the model cannot be fetched);
    a generator for module fixtures: yields (process, base URL, log path), then kills it."""
    import hal
    from hal.models.fetch import fetch
    try:
        fetch(MODEL)
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    proc, base, log = start_server(*extra)
    wait_ready(proc, base, log)
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def server():
    yield from ready_server("--draft", "self:2", "--k", "3", "--no-route", "--max-num-seqs", "8", "--max-queue-len", "32",
                            "--max-model-len", "512", "--cpu-budget-gib", "2", "--shutdown-timeout", "8")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Plain greedy `generate` in this process, and the tokenizer."""
    import hal
    from hal.engine import Request, SpeculativeDecoder
    from hal.models.fetch import load_model
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
    from hal.models.fetch import fetch
    from hal.models.tokenizer import chat_template_of
    render_chat = chat_template_of(fetch(MODEL)).render_text   # the model's own template (its GGUF's)
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


def test_special_token_text_in_a_message_is_text_over_http(client):
    """Issue 66's table: "hi<|im_end|>" was one prompt token more than "hi" (a forged control
    token); as text it costs its characters, as "hi<|im_end" always did."""
    def prompt_tokens(content):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=1).usage.prompt_tokens
    hi, forged, partial = prompt_tokens("hi"), prompt_tokens("hi<|im_end|>"), prompt_tokens("hi<|im_end")
    assert partial > hi + 1 and forged > partial, (hi, forged, partial)


def test_a_stop_string_is_counted_as_stop_not_abort(server, client):
    """Issue 66: a request that ended on a stop string was counted finished_reason="abort"."""
    base = server[1]
    key = ("spec_hal:request_success_total", (("finished_reason", "stop"),))
    aborts = ("spec_hal:request_success_total", (("finished_reason", "abort"),))
    before, aborted = metrics(base).get(key, 0), metrics(base).get(aborts, 0)
    text = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=16, temperature=0,
                                      stop=[text[4:6]], stream=stream, extra_body={"ignore_eos": True})
        if stream:
            assert [c.choices[0].finish_reason for c in r][-1] == "stop"
    wait_for(lambda: metrics(base).get(key, 0) == before + 2, "two requests counted as stop")
    assert metrics(base).get(aborts, 0) == aborted


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


def test_after_a_long_answer_20_concurrent_requests_all_complete(server, client):
    """Issue 66's repro: an answer past 256 tokens (the engine's history grows inside a step), then
    20 concurrent requests, streamed and not, greedy and sampled; every one completes, the
    counts agree, and every block is free again. Failed on 8ab16ab (every later request hung)."""
    base = server[1]
    long = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 300 and long.choices[0].finish_reason == "length"

    async def one(c, i):
        if i % 2:
            r = await c.completions.create(model=MODEL, prompt=f"List {i} fruits:", max_tokens=12 + i,
                                           temperature=0 if i % 4 == 1 else 0.8, seed=i)
            return r.choices[0].finish_reason, r.usage.completion_tokens
        n, finish = 0, None
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say {i} words."}], max_tokens=10 + i,
            temperature=0, stream=True, stream_options={"include_usage": True})
        async for ch in stream:
            if ch.choices:
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                n = ch.usage.completion_tokens
        return finish, n

    async def run():
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(c, i) for i in range(20)))
    got = asyncio.run(run())
    assert all(f in ("stop", "length") and n > 0 for f, n in got), got
    assert set(wait_all_free(base)) == {"target", "draft"}
    m = metrics(base)
    assert m[("spec_hal:num_requests_in_flight", ())] == 0 and running(base) == 0
    assert httpx.get(base + "/health").json()["status"] == "ok"


M = '"model": "smollm2-135m"'
DEEP = b"[" * 10_000 + b"]" * 10_000


@pytest.mark.parametrize("body,param", [
    (b"{not json", "body"),
    (f'{{{M}, "prompt": 5}}'.encode(), "prompt"),
    (b'{"model": "gpt-4", "prompt": "hi"}', "model"),
    (f'{{{M}, "prompt": "hi", "max_tokens": 0}}'.encode(), "max_tokens"),
    (f'{{{M}, "prompt": "hi", "max_tokens": "5"}}'.encode(), "max_tokens"),
    (f'{{{M}, "prompt": "hi", "max_tokens": 600}}'.encode(), "max_tokens"),
    (f'{{{M}, "prompt": "hi", "temperature": -1}}'.encode(), "temperature"),
    (f'{{{M}, "prompt": "hi", "n": 17}}'.encode(), "n"),
    (f'{{{M}, "prompt": "hi", "n": 0}}'.encode(), "n"),
    (f'{{{M}, "prompt": [1, 99999999]}}'.encode(), "prompt"),
    (f'{{{M}, "prompt": "hi", "speculative": {{"k": -1}}}}'.encode(), "speculative.k"),
    (f'{{{M}, "prompt": "hi", "speculative": {{"k": 4}}}}'.encode(), "speculative.k"),   # over the server's --k
    (b'[1, 2]', "body"),
    # the outside trial's defects: each a 400 naming the field, never a 500
    (f'{{{M}, "prompt": "hi", "top_k": {2 ** 62}}}'.encode(), "top_k"),
    (f'{{{M}, "prompt": "hi", "top_p": 1e-300}}'.encode(), "top_p"),
    (f'{{{M}, "prompt": "hi", "top_p": 5e-324}}'.encode(), "top_p"),
    (f'{{{M}, "prompt": "\\ud800"}}'.encode(), "body"),
    (b'{"model": "smollm2-135m", "prompt": ' + DEEP + b"}", "body"),
    (DEEP, "body"),
    (f'{{{M}, "prompt": "hi", "temperature": NaN}}'.encode(), "temperature"),
    # accepted-and-ignored fields are refused, naming them
    (f'{{{M}, "prompt": "hi", "best_of": 2}}'.encode(), "best_of"),
    (f'{{{M}, "prompt": "hi", "echo": true}}'.encode(), "echo"),
    (f'{{{M}, "prompt": "hi", "suffix": "x"}}'.encode(), "suffix"),
    # the logits processors' bounds
    (f'{{{M}, "prompt": "hi", "frequency_penalty": 2.5}}'.encode(), "frequency_penalty"),
    (f'{{{M}, "prompt": "hi", "presence_penalty": -3}}'.encode(), "presence_penalty"),
    (f'{{{M}, "prompt": "hi", "repetition_penalty": 0}}'.encode(), "repetition_penalty"),
    (f'{{{M}, "prompt": "hi", "logit_bias": {{"49152": 5}}}}'.encode(), "logit_bias"),
    (f'{{{M}, "prompt": "hi", "logit_bias": {{"1": 101}}}}'.encode(), "logit_bias"),
    (f'{{{M}, "prompt": "hi", "min_p": 1.5}}'.encode(), "min_p"),
    (f'{{{M}, "prompt": "hi", "min_tokens": -1}}'.encode(), "min_tokens"),
    (f'{{{M}, "prompt": "hi", "allowed_token_ids": []}}'.encode(), "allowed_token_ids"),
    (f'{{{M}, "prompt": "hi", "bad_words": [""]}}'.encode(), "bad_words[0]"),
    (f'{{{M}, "prompt": "hi", "response_format": {{"type": "json_schema", "json_schema": {{"name": "x", '
     f'"schema": {{"type": "nonsense"}}}}}}}}'.encode(), "response_format.json_schema.schema"),
    (f'{{{M}, "prompt": "hi", "response_format": {{"type": "xml"}}}}'.encode(), "response_format.type"),
    (f'{{{M}, "prompt": "hi", "guided_regex": "("}}'.encode(), "guided_regex"),
    (f'{{{M}, "prompt": "hi", "guided_json": {{"type": "string", "format": "made-up"}}}}'.encode(), "guided_json"),
    (f'{{{M}, "prompt": "hi", "guided_json": {{"type": "object", "if": {{}}, "then": {{}}}}}}'.encode(),
     "guided_json"),   # a keyword llguidance does not implement
    (f'{{{M}, "prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}}'.encode(), "guided_choice"),
    (f'{{{M}, "prompt": "hi", "guided_choice": []}}'.encode(), "guided_choice"),
    (f'{{{M}, "prompt": "hi", "guided_regex": "a+", "ignore_eos": true}}'.encode(), "ignore_eos"),
    (f'{{{M}, "prompt": "hi", "tools": [{{"type": "function"}}]}}'.encode(), "tools"),
    (f'{{{M}, "prompt": "hi", "no_such_field": 1}}'.encode(), "no_such_field"),
    (json.dumps({"model": MODEL, "prompt": "hi " * 600}).encode(), "prompt"),   # alone over --max-model-len
])
def test_malformed_requests_get_400_naming_the_field(server, body, param):
    r = httpx.post(server[1] + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith(param), err
    assert err["param"] == param, err


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "body"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "speculative": {"k": 99}}, "speculative.k"),
])
def test_chat_messages_are_checked(server, body, param):
    raw = json.dumps({"model": MODEL, **body}).encode()   # json.dumps keeps a lone surrogate as \ud800
    r = httpx.post(server[1] + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_null_means_unset(server):
    """The official clients and many SDKs send null for "unset": accepted, as OpenAI and vLLM do."""
    nulls = dict.fromkeys(["n", "stream", "logprobs", "top_k", "top_p", "temperature", "seed", "stop", "user",
                           "stream_options", "max_tokens", "best_of", "echo", "suffix", "logit_bias",
                           "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens",
                           "bad_words", "allowed_token_ids"])
    r = httpx.post(server[1] + "/v1/completions", json={"model": MODEL, "prompt": "hi", **nulls, "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200, r.text
    chat = {"model": MODEL, "max_tokens": 2, "n": None, "stream": None, "logprobs": None, "top_logprobs": None,
            "top_k": None, "tools": None, "tool_choice": None, "response_format": None,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "again"}]}
    r = httpx.post(server[1] + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    from hal.server.responses import ChatCompletionResponse
    ChatCompletionResponse.model_validate(r.json())   # the published response schema holds


def test_logits_processors_through_http_equal_the_engine(client, reference):
    """Penalties, logit_bias, bad_words, min_tokens and min_p over HTTP (the openai client,
    vLLM's extensions in extra_body): greedy text equal to the engine's plain greedy output
    with the same processors."""
    from hal.engine import Request, SpeculativeDecoder
    from hal.models.fetch import load_model
    import hal
    run, tok = reference
    prompt = "The cat sat on the mat. The cat sat on the"
    ids = tok.encode(prompt).ids
    extra = {"repetition_penalty": 1.3, "min_tokens": 6, "min_p": 0.05,
             "bad_words": ["mat"], "allowed_token_ids": None}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=0.6,
                                  presence_penalty=0.3, logit_bias={str(ids[-1]): -5.0}, extra_body=extra)
    model, _ = load_model(MODEL, hal.get_backend("cpu"), "auto")
    bad = tuple(dict.fromkeys(tuple(tok.encode(w).ids) for w in ("mat", " mat")))
    want = SpeculativeDecoder(model, None, num_blocks=64).generate([Request(
        ids, max_new_tokens=12, stop_ids=model.cfg.stop_ids, frequency_penalty=0.6, presence_penalty=0.3,
        repetition_penalty=1.3, logit_bias={ids[-1]: -5.0}, bad_words=bad, min_tokens=6, min_p=0.05)])[0]
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert "mat" not in r.choices[0].text


def test_a_bad_parameter_never_fails_another_clients_stream(server, client):
    """top_k 2**62 once overflowed int32 inside the step and failed every request in it."""
    base, got = server[1], {}

    def good():
        got["text"] = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0, stream=True))
    t = threading.Thread(target=good)
    t.start()
    bad = [httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "top_k": 2 ** 62 + i})
           for i in range(5)]
    t.join(120)
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "top_k" for r in bad)
    assert got["text"], got


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
    per = [k for k in after if k[0] == "spec_hal:spec_decode_num_drafts_per_drafter_total"]   # by drafting method
    assert per and all(dict(k[1]).get("drafter") for k in per), per


def running(base) -> float:
    return metrics(base).get(("spec_hal:num_requests_running", ()), 0.0)


def wait_for(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_non_streaming_client_that_disconnects_is_aborted(server):
    base = server[1]
    before = metrics(base).get(("spec_hal:request_success_total", (("finished_reason", "abort"),)), 0.0)
    body = json.dumps({"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True})
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(body)}\r\n\r\n{body}".encode())
    wait_for(lambda: blocks_used(base)["target"] > 0, "the request runs")
    sock.close()   # gone before its answer
    wait_all_free(base, timeout=60)
    wait_for(lambda: metrics(base).get(("spec_hal:request_success_total", (("finished_reason", "abort"),)), 0.0)
             > before, "the abort is counted")


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    """Tokenization runs off the event loop: /health answers while megabytes are tokenized."""
    base, done = server[1], threading.Event()
    prompt = "the quick brown fox jumps over the lazy dog " * 70_000   # 3 MB: about 2 s to tokenize

    def huge():
        try:
            httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=300)
        finally:
            done.set()
    t = threading.Thread(target=huge)
    t.start()
    answered = 0
    while not done.is_set() and answered < 3:
        answered += httpx.get(base + "/health", timeout=300).status_code == 200
    t.join(300)
    assert answered >= 3


def test_a_shared_system_prompt_hits_the_prefix_cache(server, client):
    """The second chat with the same ~100-token system turn prefills from the cache, and
    greedy output is the same both times."""
    base, system = server[1], "You are a careful assistant who answers briefly. " * 8
    before = metrics(base)
    outs = [client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]).choices[0].message.content
        for _ in range(2)]
    after = metrics(base)
    key = ("spec_hal:prefix_cache_hits_total", ())
    assert after[key] - before.get(key, 0.0) >= 64, "the second request should find the system turn's blocks"
    assert outs[0] == outs[1]
    assert 0 < after[("spec_hal:prefix_cache_hit_rate", ())] <= 1


def test_n_choices_are_each_their_own_seed_stream(server, client):
    """``n = 3`` gives the three answers that ``n = 1`` gives with seeds s, s + 1 and s + 2
    (vLLM's streams), with logprobs per choice; the prompt is computed once."""
    base, system = server[1], "You are a careful assistant who answers briefly. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say something odd."}]
    before = metrics(base)
    many = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.9, seed=41,
                                          n=3, logprobs=True, top_logprobs=2)
    hits = metrics(base)[("spec_hal:prefix_cache_hits_total", ())] - before.get(("spec_hal:prefix_cache_hits_total", ()), 0)
    assert hits >= 2 * 64, "choices 1 and 2 should reuse the prompt's blocks"
    assert [c.index for c in many.choices] == [0, 1, 2]
    ones = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.9,
                                           seed=41 + i, logprobs=True, top_logprobs=2) for i in range(3)]
    singles = [one.choices[0] for one in ones]
    assert [c.message.content for c in many.choices] == [c.message.content for c in singles]
    assert len({c.message.content for c in many.choices}) > 1, "three seeds gave one answer"
    for c, one in zip(many.choices, singles):
        assert [t.token for t in c.logprobs.content] == [t.token for t in one.logprobs.content]
        assert len(c.logprobs.content[0].top_logprobs) == 2
    assert many.usage.completion_tokens == sum(one.usage.completion_tokens for one in ones) \
        == sum(len(c.logprobs.content) for c in many.choices)


def test_n_choices_stream_interleaved_and_match_the_whole_response(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.8, seed=7, n=2)
    whole = client.completions.create(**kw)
    texts, finish = ["", ""], [None, None]
    for ch in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                assert finish[c.index] is None, "a choice finished twice"
                finish[c.index] = c.finish_reason
        if ch.usage is not None:
            assert ch.usage.completion_tokens == whole.usage.completion_tokens
    assert texts == [c.text for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices] and None not in finish


PERSON = {"type": "object", "additionalProperties": False, "required": ["age", "likes"], "properties": {
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "likes": {"type": "array", "items": {"enum": ["tea", "cats", "rain"]}, "minItems": 1, "maxItems": 2}}}


def test_json_schema_responses_parse_across_20_seeded_sampled_requests(server, client):
    """response_format json_schema through the official client: every one of 20 sampled
    answers (seeds 0..19, speculative decoding on) parses and validates against its schema."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema_rs   # schemathesis's validator
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(seed):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                           max_tokens=48, temperature=1.0, seed=seed, response_format=fmt)
        return r.choices[0]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(20)))
    for a in answers:
        assert a.finish_reason == "stop", a
        jsonschema_rs.validate(PERSON, json.loads(a.message.content))
    assert len({a.message.content for a in answers}) > 6, "20 seeds gave few different answers"


def test_guided_decoding_greedy_equals_plain_and_follows_the_grammar(client):
    """vLLM's guided_json / guided_regex / guided_choice and json_object, greedy: the speculative
    answer equals the plain one (``speculative.k = 0``) under the same grammar."""
    cases = [({"guided_json": PERSON}, lambda s: json.loads(s) is not None),
             ({"guided_regex": "[A-Z][a-z]{2,8} (is|was) [0-9]{1,2}"},
              lambda s: re.fullmatch("[A-Z][a-z]{2,8} (is|was) [0-9]{1,2}", s)),
             ({"guided_choice": ["yes", "no", "maybe not"]}, lambda s: s in ("yes", "no", "maybe not")),
             ({"response_format": {"type": "json_object"}}, lambda s: isinstance(json.loads(s), dict))]
    for extra, ok in cases:
        rf = extra.pop("response_format", None)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Is the sky green? Answer in JSON."}],
                  max_tokens=32, temperature=0, **({"response_format": rf} if rf else {}))
        spec = client.chat.completions.create(**kw, extra_body=extra).choices[0]
        plain = client.chat.completions.create(**kw, extra_body={**extra, "speculative": {"k": 0}}).choices[0]
        assert spec.message.content == plain.message.content, extra or rf
        if spec.finish_reason == "stop":
            assert ok(spec.message.content), (extra or rf, spec.message.content)


def test_parameters_that_leave_no_token_fail_only_that_request(server, client):
    """schemathesis's finding: a grammar ("0") whose only token allowed_token_ids excludes was a
    500 for every request in the step; now that request alone is a 400, and a concurrent
    stream completes."""
    base = server[1]
    with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "a b a b a b", "max_tokens": 24, "temperature": 0, "stream": True}) as s:
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Say zero.", "guided_regex": "0", "allowed_token_ids": [5], "temperature": 1})
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]


def test_startup_shows_its_phases_in_order(server):
    log = open(server[2]).read()
    lines = [line for line in log.splitlines() if line.startswith("spec-hal serve: ")]
    order = ["listening on", "linear plan", "memory plan", "load smollm2-135m", "draft self:2", "prefix caching on",
             "ready in"]
    at = [next(i for i, line in enumerate(lines) if line.startswith("spec-hal serve: " + o)) for o in order]
    assert at == sorted(at), lines
    # chunked prefill is on by default, its budget stated (issue 66: a long prompt froze every stream)
    assert "spec-hal serve: chunked prefill: 256 tokens a step (--max-num-batched-tokens unset: the default for " \
           "cpu)" in lines, lines


def test_the_default_token_budget_is_per_device_and_covers_every_running_request():
    from hal.launch.build import serving_budget
    assert serving_budget("cpu", 32) == 256 and serving_budget("cuda", 32) == 2048 and serving_budget("npu", 8) == 2048
    assert serving_budget("cpu", 512) == 512   # every running request feeds at least one token


def test_while_loading_the_port_answers_503(server):
    """The outside trial: during start-up the port was bound but refused connections, though
    the log said "listening". Now, from that line on, /health answers 503 ``loading`` (with
    Retry-After) until it answers 200; never a refused connection."""
    seen = LOADING[server[1]]
    assert seen and seen[-1][0] == 200, seen
    assert all(code == 503 and body == {"status": "loading", "reason": "the server is starting: loading the model"}
               for code, body in seen[:-1]), seen
    assert len(seen) > 1, "the module's server was never seen loading"


def test_a_taken_port_fails_at_once_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, _, log = start_server("--draft", "ngram", port=port)
        try:
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    out = open(log).read()
    assert rc == 2 and "--port" in out and str(port) in out and "in use" in out, out
    assert not any(f"spec-hal serve: {phase}" in out for phase in ("load", "linear plan", "ready")), out


SCHEMA_CONST = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "<|im_end|>"}}}
SPECIAL_TOKEN_GRAMMARS = [   # the outside trial's reproducers: each ended every request in flight
    ({"guided_choice": ["<|im_end|>"]}, "guided_choice"),
    ({"guided_choice": ["<|im_start|>"]}, "guided_choice"),
    ({"guided_choice": ["a<|im_end|>b"]}, "guided_choice"),
    ({"guided_regex": "<\\|im_end\\|>"}, "guided_regex"),
    ({"guided_regex": "a<\\|endoftext\\|>"}, "guided_regex"),
    ({"guided_json": {"const": "<|im_end|>"}}, "guided_json"),
    ({"guided_json": {"enum": ["<|im_end|>"]}}, "guided_json"),
    ({"response_format": SCHEMA_CONST}, "response_format.json_schema.schema"),
    ({"guided_choice": ["<|im_end|>"], "stream": True}, "guided_choice"),
    ({"guided_choice": ["<|im_end|>"], "speculative": {"k": 0}}, "guided_choice"),
    ({"guided_choice": ["<|im_end|>"], "n": 2}, "guided_choice"),
]


def test_special_token_grammars_fail_alone_while_another_stream_finishes_intact(server):
    """Each reproducer is a 400 naming its field (refused at compile time), sent while another
    client's greedy stream runs; that stream ends with ``finish_reason: "length"``, no error
    event and the text it has alone. A grammar that plain text can still satisfy (``yes``
    beside ``<|im_end|>``) is answered in plain tokens (the text ``<|im_end|>`` spelled out is
    in its language too), the special token left out of the masks until it is complete."""
    base = server[1]
    victim = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
              "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(base + "/v1/chat/completions", json=victim, timeout=120).json()["choices"][0]

    def attack(extra):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
        return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)

    with httpx.stream("POST", base + "/v1/chat/completions", json={**victim, "stream": True}, timeout=120) as s:
        lines = s.iter_lines()
        got = [next(line for line in lines if line.startswith("data: "))]
        answers = [attack(extra) for extra, _ in SPECIAL_TOKEN_GRAMMARS]
        mixed = attack({"guided_choice": ["<|im_end|>", "yes"]})
        got += [line for line in lines if line.startswith("data: ")]
    for (extra, param), r in zip(SPECIAL_TOKEN_GRAMMARS, answers):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        assert "special token" in r.json()["error"]["message"], r.text
    assert mixed.status_code == 200 and mixed.json()["choices"][0]["message"]["content"] in ("yes", "<|im_end|>") \
        and mixed.json()["choices"][0]["finish_reason"] == "stop", mixed.text
    chunks = [json.loads(line[6:]) for line in got if line != "data: [DONE]"]
    assert got[-1] == "data: [DONE]" and not any("error" in c for c in chunks), got[-3:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert text == alone["message"]["content"] and finish == [alone["finish_reason"]] == ["length"], (text, finish)


def test_the_openai_chat_loop_appends_each_answer_as_it_is(client):
    """Three turns with the official client, each answer appended as
    ``resp.choices[0].message.model_dump()`` (``refusal``, ``audio``, ``function_call``,
    ``tool_calls``, ``annotations`` as null), and ``name`` on the user's turns; what this
    server never produces stays refused by name."""
    messages = [{"role": "system", "content": "Answer briefly.", "name": "rules"}]
    for turn in ("Name a colour.", "Name another.", "And one more."):
        messages.append({"role": "user", "content": turn, "name": "ada"})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        assert r.choices[0].message.content
        messages.append(r.choices[0].message.model_dump())
    assert {"refusal", "tool_calls", "annotations"} <= set(messages[-1]) and len(messages) == 7
    empty = {**messages[2], "tool_calls": [], "annotations": []}
    assert client.chat.completions.create(model=MODEL, messages=messages[:2] + [empty, messages[3]], max_tokens=2,
                                          temperature=0).choices[0].message.content is not None
    for field, value in (("refusal", "no"), ("tool_calls", [{"id": "1"}]), ("reasoning", "x")):
        bad = messages[:2] + [{**messages[2], field: value}, messages[3]]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=bad, max_tokens=2)
        assert e.value.body["param"] == f"messages[2].{field}", e.value.body


def test_a_body_cut_short_logs_one_line(server):
    """A body shorter than its Content-Length, then a close: one line in the log (it was a
    60-line ClientDisconnect traceback any client could repeat), and the server serves on."""
    before = open(server[2]).read()
    host, port = server[1].rsplit("//", 1)[1].split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")
    deadline = time.monotonic() + 30
    while open(server[2]).read().count("a client disconnected after") < before.count(
            "a client disconnected after") + 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    new = open(server[2]).read()[len(before):]
    assert new.count("a client disconnected after 9 of 100 body bytes") == 3 and "Traceback" not in new, new
    assert httpx.get(server[1] + "/health").status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {
        "schema": {}}}}, "response_format.json_schema.name"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}, "logit_bias"),
])
def test_the_trials_validation_gaps_are_400s_with_short_messages(server, body, param):
    r = httpx.post(server[1] + "/v1/chat/completions", json={"model": MODEL, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["message"].startswith(param + ":"), r.text
    assert len(err["message"]) < 160 and "^(" not in err["message"], err


# last: it stops the module's server
def test_sigterm_finishes_short_requests_ends_the_rest_cleanly_and_exits_0(server, client):
    """SIGTERM with streams, a long non-streaming request and a short one in flight: the short
    one finishes; new requests get 503 JSON (the port stays open until exit); at --shutdown-timeout each stream ends with a final chunk (finish_reason
    "abort") and [DONE], the long non-streaming request gets a 503 JSON body; exit 0 and no
    traceback in the log. Waits on conditions only (busy machines)."""
    proc, base, log = server
    long = {"model": MODEL, "prompt": "Write a long story about the sea.", "max_tokens": 480, "ignore_eos": True}
    out, lines = {}, {i: [] for i in range(3)}

    def stream(i):
        with httpx.stream("POST", base + "/v1/completions", json={**long, "stream": True}, timeout=120) as r:
            lines[i] = [line for line in r.iter_lines() if line]

    def plain(name, body):
        out[name] = httpx.post(base + "/v1/completions", json=body, timeout=120)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=plain, args=("long", long)))
    for t in threads:
        t.start()
    wait_for(lambda: running(base) >= 4, "four requests run")
    short = threading.Thread(target=plain, args=("short", {"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                             "temperature": 0}))
    short.start()
    wait_for(lambda: running(base) >= 5 or "short" in out, "the short request is admitted")
    proc.send_signal(signal.SIGTERM)
    after = None
    deadline = time.monotonic() + 60
    while after is None and time.monotonic() < deadline:   # until the engine says it is closing
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        after = r if r.status_code == 503 else None
    for t in [*threads, short]:
        t.join(120)
    assert proc.wait(60) == 0
    assert out["short"].status_code == 200, out["short"].text
    assert out["short"].json()["choices"][0]["finish_reason"] in ("length", "stop")
    # a new request after SIGTERM: 503 JSON while the streams still run (it was "connection refused")
    assert after is not None and after.json()["error"]["type"] == "service_unavailable", after
    assert all(len(lines[i]) > 0 and lines[i][-1] == "data: [DONE]" for i in range(3))
    assert out["long"].status_code == 503 and out["long"].json()["error"]["type"] == "service_unavailable", \
        out["long"].text
    for i in range(3):
        assert lines[i][-1] == "data: [DONE]", lines[i][-3:]
        last = json.loads(lines[i][-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "abort", last
    text = open(log).read()
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-3000:]
