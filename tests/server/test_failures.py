"""Failures answer their own request (issue 66), on a server in this process (SmolLM2-135M, n-gram
drafts) so that a fault can be planted in its engine:

* `SpeculativeDecoder.add` raising something other than a `HalError` answers that client with a
  500 naming the failure, while a concurrent stream completes and later requests are served;
* a step that fails (the engine itself: no one request explains it) answers every request in
  flight with a 500, turns /health to 503 and stops the server (`spec-hal serve` then exits
  non-zero); it never hangs a client."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "smollm2-135m"
POISON = [4321, 4321, 4321]   # a prompt that starts so makes the planted `add` raise


def wait_for(cond, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def loaded():
    import hal
    from hal.models.fetch import fetch, load_model
    try:
        fetch(MODEL)
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    return load_model(MODEL, hal.get_backend("cpu"), "auto")


def serve(model, tok):
    """An app over a fresh engine on a free port, served from a thread: (base URL, engine, server, thread)."""
    from hal.drafters import NgramDrafter
    from hal.engine import SpeculativeDecoder
    from hal.launch.start import Target
    from hal.server.app import make_app
    from hal.server.transport import bind, uvicorn_server
    dec = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=128, max_num_seqs=4)
    app = make_app(Target(dec, tok, 1, None, None), MODEL, 1024, 3, 16, shutdown_timeout=2.0)
    sock = bind("127.0.0.1", 0)
    server = uvicorn_server(app, sock, 2.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_for(lambda: server.started, "the server to start")
    return base, dec, server, thread


def in_flight(base) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            if s.name == "spec_hal:num_requests_in_flight":
                return s.value
    raise AssertionError("no spec_hal:num_requests_in_flight in /metrics")


def test_a_failing_add_answers_only_its_own_client(loaded):
    """Failed on 8ab16ab: the planted failure cut the concurrent stream too."""
    base, dec, server, thread = serve(*loaded)
    real = dec.add

    def add(req):
        if list(req.prompt_ids[:3]) == POISON:
            raise RuntimeError("planted add failure")
        return real(req)
    dec.add = add
    try:
        async def run():
            c = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)

            async def stream():
                n, finish = 0, None
                s = await c.completions.create(model=MODEL, prompt="The history of the bicycle", max_tokens=64,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
                async for ch in s:
                    n += 1
                    finish = ch.choices[0].finish_reason or finish
                return finish

            async def poisoned():
                await asyncio.sleep(0)
                with pytest.raises(openai.InternalServerError) as e:
                    await c.completions.create(model=MODEL, prompt=POISON + [1, 2], max_tokens=8)
                return str(e.value)
            return await asyncio.gather(stream(), poisoned(), poisoned())
        finish, why, why2 = asyncio.run(run())
        assert finish == "length"
        assert "planted add failure" in why and "could not queue this request" in why and why == why2
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        assert c.completions.create(model=MODEL, prompt="Hello", max_tokens=5).usage.completion_tokens == 5
        assert in_flight(base) == 0 and not dec.has_unfinished()
        assert httpx.get(base + "/health").json() == {"status": "ok"}
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_broken_engine_fails_its_requests_health_and_stops_the_server(loaded):
    base, dec, server, thread = serve(*loaded)
    real, steps = dec.step, []

    def step():
        steps.append(1)
        if len(steps) == 5:
            raise RuntimeError("planted step failure")
        return real()
    dec.step = step
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.InternalServerError, match="the engine failed: RuntimeError: planted step failure"):
            c.completions.create(model=MODEL, prompt="Hello there", max_tokens=32, extra_body={"ignore_eos": True})
        wait_for(lambda: server.should_exit, "the server to stop after the engine failed", 30)
        thread.join(30)
        assert not thread.is_alive()
        assert server.config.app.state.loop.failed
    finally:
        server.should_exit = True
        thread.join(30)
