"""An OpenAI-compatible HTTP server with speculative decoding: ``spec-hal serve`` or
``python -m hal serve`` (under torchrun with a draft rank: ``torchrun --nproc-per-node 2
-m hal.server.app ...``; this process is then the target rank).

FastAPI + uvicorn. One engine loop (`EngineLoop`) runs `SpeculativeDecoder.step` in its
own thread; HTTP handlers talk to it through queues only, so a slow client never stalls
a step. Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, updated
every step). A client that disconnects is aborted and its KV blocks freed (target and
draft); past ``--max-num-seqs + --max-queue-len`` requests in flight the answer is 503
with ``Retry-After``; SIGTERM stops accepting, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, aborts the rest and exits 0."""


import argparse
import asyncio
import json
import queue
import signal
import sys
import threading
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

from hal.errors import HalError
from hal.server.openai_schema import (ApiError, Parsed, TextState, chunk, logprobs_chat, logprobs_completion, new_id,
                                      parse,
                            response, usage)
from hal.engine.requests import Request, check_request


@dataclass
class Handle:
    """One HTTP request as the engine loop sees it; events go back through ``q``."""

    parsed: Parsed
    q: asyncio.Queue
    aio: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    rid: int | None = None
    first: float | None = None
    generated: int = 0
    last: int | None = None
    cancelled: bool = False
    done: bool = False

    def push(self, event: tuple) -> None:
        try:
            self.aio.call_soon_threadsafe(self.q.put_nowait, event)
        except RuntimeError:   # the event loop is gone (shutdown)
            pass


class Busy(Exception):
    pass


class EngineLoop:
    """Owns the engine: adds, aborts and steps in one thread. ``submit`` and ``abort`` are
    safe from any thread; events reach each request's asyncio queue."""

    def __init__(self, dec, metrics=None, max_in_flight: int = 256):
        self.dec, self.metrics, self.max_in_flight = dec, metrics, max_in_flight
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[int, Handle] = {}
        self.in_flight, self._lock = 0, threading.Lock()
        self._stop = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="hal-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        self.thread.join(timeout)

    def submit(self, h: Handle) -> None:
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                raise Busy
            self.in_flight += 1
        self.inbox.put(("add", h))

    def abort(self, h: Handle) -> None:
        self.inbox.put(("abort", h))

    def _done(self, h: Handle, event: tuple) -> None:
        if not h.done:
            h.done = True
            with self._lock:
                self.in_flight -= 1
            h.push(event)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.dec.has_unfinished())
                if self.dec.has_unfinished():
                    self._dispatch(self.dec.step())
            except Exception as e:   # never leave a client hanging: fail what is in flight, keep serving
                self.error = f"{type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stderr)
                for rid, h in list(self.live.items()):
                    self.dec.abort(rid)
                    self._done(h, ("error", self.error))
                self.live.clear()
        for rid, h in list(self.live.items()):   # shutting down: abort what is left
            self.dec.abort(rid)
            self._done(h, ("finished", "abort"))
        self.live.clear()

    def _drain(self, block: bool) -> None:
        items = []
        try:
            items.append(self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        for kind, handle in items:
            if kind == "add":
                if handle.cancelled:
                    self._done(handle, ("finished", "abort"))
                    continue
                try:
                    handle.rid = self.dec.add(Request(handle.parsed.prompt_ids, **asdict(handle.parsed.params)))
                except HalError as e:
                    self._done(handle, ("error", str(e)))
                    continue
                self.live[handle.rid] = handle
            elif kind == "abort":
                handle.cancelled = True
                if handle.rid is not None and self.live.pop(handle.rid, None) is not None:
                    self.dec.abort(handle.rid)   # frees its blocks now, target and draft
                    if self.metrics:
                        self.metrics.finished(handle.arrival, handle.first, time.perf_counter(),
                                              len(handle.parsed.prompt_ids),
                                              handle.generated, "abort")
                    self._done(handle, ("finished", "abort"))
        if items and self.metrics:
            self.metrics.gauges(self.dec)

    def _dispatch(self, out) -> None:
        now = time.perf_counter()
        for rid, toks in out.tokens.items():
            if (handle := self.live.get(rid)) is None:
                continue
            if handle.first is None:
                handle.first = now
                if self.metrics:
                    self.metrics.first_token(handle.arrival, now)
            handle.generated += len(toks)
            handle.last = toks[-1]
            handle.push(("tokens", toks, out.logprobs.get(rid)))
        if self.metrics:
            self.metrics.step(self.dec, out)
        for rid in out.finished:
            if (handle := self.live.pop(rid, None)) is None:
                continue
            reason = "stop" if handle.last in handle.parsed.params.stop_ids else "length"
            if self.metrics:
                self.metrics.finished(handle.arrival, handle.first, now, len(handle.parsed.prompt_ids),
                                      handle.generated, reason)
            self._done(handle, ("finished", reason))


MAX_BODY = 8 << 20   # bytes: far above any prompt within --max-model-len; a bigger body is refused unread


async def read_body(request) -> bytes:
    """The request body, refused with 413 past `MAX_BODY` (declared or streamed)."""
    n = request.headers.get("content-length")
    if n is not None and (not n.isdigit() or int(n) > MAX_BODY):
        raise ApiError(f"body: expected at most {MAX_BODY} bytes, got {n}", "body", 413)
    chunks, size = [], 0
    async for c in request.stream():
        size += len(c)
        if size > MAX_BODY:
            raise ApiError(f"body: expected at most {MAX_BODY} bytes, got more", "body", 413)
        chunks.append(c)
    return b"".join(chunks)


def make_app(target, served: str, max_model_len: int, default_k: int, max_in_flight: int):
    """The FastAPI app over a `hal.distributed.launcher.Target` (engine + tokenizer)."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from hal.server.live_metrics import LiveMetrics
    dec, tok = target.dec, target.tok
    dec.metrics.bound(10_000)   # live figures go to prometheus; keep the in-process samples bounded
    metrics = LiveMetrics(max_k=max(default_k, 1))
    loop = EngineLoop(dec, metrics, max_in_flight)

    @asynccontextmanager
    async def lifespan(_app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()
            target.close()

    app = FastAPI(title="spec-hal", lifespan=lifespan)
    app.state.loop, app.state.metrics = loop, metrics

    def error(e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def accept(request: HttpRequest, chat: bool):
        try:
            body = json.loads(await read_body(request))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(f"body: expected JSON, got a parse error ({e})", "body") from None
        parsed = parse(body, chat=chat, tok=tok, served=served, max_model_len=max_model_len, default_k=default_k,
                  stop_ids=dec.target.cfg.stop_ids)
        try:   # the engine's own checks (token ids, KV pool size), before the request is queued
            check_request(Request(parsed.prompt_ids, **asdict(parsed.params)), dec.target.cfg.vocab, dec.pool.allocator)
        except HalError as e:
            field = str(e).split(":")[0]
            raise ApiError(str(e), field if field.isidentifier() else None) from None
        if loop.error is not None and not loop.thread.is_alive():
            raise ApiError("the engine loop stopped", None, 503, "server_error")
        h = Handle(parsed, asyncio.Queue(), asyncio.get_running_loop())
        try:
            loop.submit(h)
        except Busy:
            raise ApiError(f"server busy: {max_in_flight} requests in flight; retry later", None, 503,
                           "server_busy", {"Retry-After": "1"}) from None
        return parsed, h

    async def events(handle: Handle, request: HttpRequest, poll: bool):
        """The request's engine events; ends the request if the client goes away."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(handle.q.get(), 0.5)
                except asyncio.TimeoutError:
                    if poll and await request.is_disconnected():
                        return
                    continue
                yield event
                if event[0] != "tokens":
                    return
        finally:
            if not handle.done:
                loop.abort(handle)

    async def handle(request: HttpRequest, chat: bool):
        try:
            parsed, h = await accept(request, chat)
        except ApiError as e:
            return error(e)
        rid, text, logprobs = new_id(chat), TextState(tok, parsed.stop), []
        if parsed.stream:
            return StreamingResponse(stream(parsed, h, rid, text, chat, request), media_type="text/event-stream")
        parts, finish = [], "abort"
        async for event in events(h, request, poll=True):
            if event[0] == "tokens":
                parts.append(text.add(event[1]))
                logprobs += event[2] or []
                if text.stopped:
                    finish = "stop"
                    break
            elif event[0] == "error":
                return error(ApiError(event[1], None, 500, "server_error"))
            else:
                finish = event[1]
        parts.append(text.finish())
        n = text.kept_tokens if text.stopped else len(text.ids)
        lps = None if parsed.logprobs is None else (logprobs_chat if chat else logprobs_completion)(tok, logprobs[:n])
        return JSONResponse(response(chat, rid, parsed.model, "".join(parts), finish, lps,
                                     usage(len(parsed.prompt_ids), n)))

    async def stream(parsed: Parsed, handle: Handle, rid: str, text: TextState, chat: bool, request):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"
        if chat:
            yield sse(chunk(True, rid, parsed.model, None, role=True))
        else:   # an SSE comment: the response starts now, even while the request waits for a slot
            yield ": spec-hal\n\n"
        finish = "abort"
        async for event in events(handle, request, poll=False):
            if event[0] == "tokens":
                delta = text.add(event[1])
                logprobs = None
                if parsed.logprobs is not None and event[2]:
                    keep = event[2][:max(0, text.kept_tokens - (len(text.ids) - len(event[1])))] \
                        if text.stopped else event[2]
                    logprobs = (logprobs_chat if chat else logprobs_completion)(tok, keep)
                if delta or logprobs:
                    yield sse(chunk(chat, rid, parsed.model, delta, lp=logprobs))
                if text.stopped:
                    finish = "stop"
                    break
            elif event[0] == "error":
                yield sse(ApiError(event[1], None, 500, "server_error").body())
                return
            else:
                finish = event[1]
        if tail := text.finish():
            yield sse(chunk(chat, rid, parsed.model, tail))
        yield sse(chunk(chat, rid, parsed.model, None if chat else "", finish=finish))
        if parsed.include_usage:
            n = text.kept_tokens if text.stopped else len(text.ids)
            yield sse(chunk(chat, rid, parsed.model, None, use=usage(len(parsed.prompt_ids), n)))
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                            "owned_by": "spec-hal", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if not loop.thread.is_alive():
            return JSONResponse({"status": "error", "reason": loop.error or "the engine loop stopped"}, 503)
        why = target.degraded
        return {"status": "ok"} if why is None else {"status": "degraded", "reason": why}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def main(argv: list[str] | None = None) -> int:
    from hal.distributed.launcher import add_engine_args, start
    parser = argparse.ArgumentParser(prog="spec-hal serve", description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="tokens fed to the target per step (none: unbounded)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once")
    parser.add_argument("--max-model-len", type=int, default=2048, help="prompt + generated tokens per request")
    parser.add_argument("--max-queue-len", type=int, default=256, help="requests waiting beyond --max-num-seqs; "
                                                                    "past it: 503 with Retry-After")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get on SIGTERM")
    args = parser.parse_args(argv)
    args.max_context = args.max_model_len
    try:
        import uvicorn
        target = start(args, args.max_num_seqs, {"max_num_batched_tokens": args.max_num_batched_tokens,
                                                 "max_num_seqs": args.max_num_seqs})
        if target is None:   # the draft rank served until the target stopped
            return 0
        if target.tok is None:
            raise HalError(f"--model: expected a model with a tokenizer (GGUF), got {args.model}")
        app = make_app(target, args.served_model_name or args.model, args.max_model_len, args.k,
                       args.max_num_seqs + args.max_queue_len)
    except HalError as e:
        print(f"spec-hal serve: {e}", file=sys.stderr)
        return 2
    print(f"spec-hal serve: http://{args.host}:{args.port}/v1 (model {args.served_model_name or args.model}, "
          f"draft {args.draft}, k {args.k}{', routed' if args.route else ''})", file=sys.stderr, flush=True)
    # uvicorn re-raises the SIGTERM it handled once it has shut down; with this handler
    # in place that is a no-op, so a graceful stop exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=max(1, int(args.shutdown_timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
