"""An OpenAI-compatible HTTP server with speculative decoding: ``spec-hal serve`` or
``python -m hal serve`` (under torchrun with a draft rank: ``torchrun --nproc-per-node 2
-m hal.server.app ...``; this process is then the target rank).

FastAPI + uvicorn. One engine loop (`EngineLoop`) runs `SpeculativeDecoder.step` in its
own thread; HTTP handlers talk to it through queues only, so a slow client never stalls
a step. Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, updated
every step), ``GET /openapi.json`` (the request and response bodies as declared models,
`hal.server.protocol`: the schema is the validation). The port is taken before anything
loads. A client that disconnects (streaming or not) is aborted and its KV blocks freed
(target and draft); past ``--max-num-seqs + --max-queue-len`` requests in flight the
answer is 503 with ``Retry-After``; SIGTERM stops accepting, lets in-flight requests
finish for up to ``--shutdown-timeout`` seconds, then ends each stream still running with
``finish_reason: "abort"`` and ``[DONE]`` (a non-streaming request gets a 503 JSON body),
and exits 0."""


import argparse
import asyncio
import json
import os
import signal
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import replace

from hal.engine.requests import check_request
from hal.errors import HalError
from hal.server.engine_loop import Busy, Closing, EngineLoop, Failed, Finished, Handle, Shutdown, Tokens
from hal.server.loading import LoadingResponder
from hal.server.transport import bind, read_body, uvicorn_server
from hal.server.openai_schema import (ApiError, Parsed, TextState, chunk, logprobs_chat, logprobs_completion, new_id,
                                      parse, response, usage)
from hal.server.protocol import WireModels, wire_models
from hal.server.responses import ChatCompletionResponse, CompletionResponse, ErrorResponse, Health, ModelList


ENGINE_NAMES = {"prompt_ids": "prompt", "max_new_tokens": "max_tokens", "prompt_ids + max_new_tokens": "max_tokens"}


def _responses(model) -> dict:
    """The documented answers of a completion endpoint: JSON or an SSE stream, and the errors."""
    err = {"model": ErrorResponse}
    event = {"type": "object", "required": ["data"], "description": "one SSE event: a JSON chunk, or [DONE] last",
             "properties": {"data": {"type": "string"}}}
    return {200: {"model": model, "content": {"text/event-stream": {"schema": event}}},
            400: {**err, "description": "a bad request: ``param`` names the field"},
            413: {**err, "description": "a body over 8 MiB"},
            500: {**err, "description": "the engine failed (never a request's own parameters)"},
            503: {**err, "description": "busy (with Retry-After) or shutting down",
                  "headers": {"Retry-After": {"schema": {"type": "string"}, "description": "seconds (when busy)"}}}}


def _openapi(app, wire: WireModels) -> dict:
    """FastAPI's document with the request bodies declared: the models the handlers
    validate with (`hal.server.protocol`)."""
    from fastapi.openapi.utils import get_openapi
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in (("/v1/completions", wire.completion), ("/v1/chat/completions", wire.chat)):
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": {
                    "$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = doc
    return app.openapi_schema


def make_app(target, served: str, max_model_len: int, default_k: int, max_in_flight: int,
             shutdown_timeout: float = 10.0):
    """The FastAPI app over a `hal.distributed.launcher.Target` (engine + tokenizer)."""
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from hal.server.live_metrics import LiveMetrics
    dec, tok = target.dec, target.tok
    dec.metrics.bound(10_000)   # live figures go to prometheus; keep the in-process samples bounded
    metrics = LiveMetrics(max_k=max(default_k, 1))
    loop = EngineLoop(dec, metrics, max_in_flight, on_idle=target.on_idle)
    wire = wire_models(served, max_model_len, dec.target.cfg.vocab, default_k)

    @asynccontextmanager
    async def lifespan(_app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()
            target.close()

    from importlib.metadata import PackageNotFoundError, version
    try:
        release = version("spec-hal")
    except PackageNotFoundError:
        release = "0"
    app = FastAPI(title="spec-hal", version=release, lifespan=lifespan,
                  description="An OpenAI-compatible server with speculative decoding. Request bodies are "
                              "validated against the schemas below (closed: unknown fields are refused).")
    app.state.loop, app.state.metrics = loop, metrics
    app.state.shutdown_timeout = shutdown_timeout
    app.openapi = lambda: _openapi(app, wire)

    def error(e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def check(raw: bytes, chat: bool) -> Parsed:
        """Validate, tokenize and check against the engine: off the event loop (a prompt of
        megabytes takes seconds to tokenize)."""
        parsed = parse(raw, chat=chat, tok=tok, wire=wire, max_model_len=max_model_len, default_k=default_k,
                       stop_ids=dec.target.cfg.stop_ids)
        try:   # the engine's own checks (token ids, KV pool size), before the request is queued
            check_request(parsed.params.request(parsed.prompt_ids), dec.target.cfg.vocab, dec.pool.allocator)
        except HalError as e:
            name = str(e).split(":")[0]
            name = ENGINE_NAMES.get(name, name if name.isidentifier() else None)
            raise ApiError(str(e), "messages" if chat and name == "prompt" else name) from None
        if parsed.params.structured is not None:   # compile here, off the engine loop, to answer 400 now
            if dec.grammar is None:
                raise ApiError(f"{parsed.structured_field}: structured outputs need the llguidance package on the "
                               "server (pip install llguidance)", parsed.structured_field.split(".")[0])
            try:
                dec.grammar.matcher(parsed.params.structured)
            except HalError as e:
                raise ApiError(f"{parsed.structured_field}: {str(e).split(': ', 1)[-1]}",
                               parsed.structured_field) from None
        return parsed

    def invalid(message: str, parsed: Parsed) -> ApiError:
        """A request its own parameters stopped (`StepOutput.errors`): a 400 naming the first."""
        name = message.split(":")[0]
        if name == "structured":
            name, message = parsed.structured_field, f"{parsed.structured_field}{message[len('structured'):]}"
        return ApiError(message, name if name.isidentifier() or "." in name else None)

    def failure(event: Failed, parsed: Parsed) -> ApiError:
        return invalid(event.message, parsed) if event.invalid else ApiError(event.message, None, 500, "server_error")

    async def accept(request: HttpRequest, chat: bool):
        """The checked request and one engine handle per choice (all queued, or none)."""
        if loop.closing:
            raise ApiError("the server is shutting down", None, 503, "service_unavailable")
        parsed = await asyncio.to_thread(check, await read_body(request), chat)
        if loop.error is not None and not loop.thread.is_alive():
            raise ApiError("the engine loop stopped", None, 503, "server_error")
        aio = asyncio.get_running_loop()
        handles = [Handle(replace(parsed, params=parsed.sample_params(i)), asyncio.Queue(), aio)
                   for i in range(parsed.n)]
        try:
            loop.submit_all(handles)
        except Busy:
            raise ApiError(f"server busy: {max_in_flight} requests in flight; retry later", None, 503,
                           "server_busy", {"Retry-After": "1"}) from None
        except Closing:
            raise ApiError("the server is shutting down", None, 503, "service_unavailable") from None
        return parsed, handles

    async def disconnected(request: HttpRequest) -> None:
        """Returns once the client has gone (the body is already read)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def events(handles: list[Handle], request: HttpRequest | None):
        """``(choice, event)`` until every choice has ended; with ``request``, ends early if
        the client goes away. Whatever way it ends, a choice still running is aborted."""
        gone = asyncio.ensure_future(disconnected(request)) if request is not None else None
        gets = {asyncio.ensure_future(h.q.get()): i for i, h in enumerate(handles)}
        try:
            while gets:
                done, _ = await asyncio.wait(set(gets) | ({gone} - {None}), return_when=asyncio.FIRST_COMPLETED)
                for get in sorted(done - {gone}, key=gets.get):
                    i, event = gets.pop(get), get.result()
                    yield i, event
                    if isinstance(event, Tokens):
                        gets[asyncio.ensure_future(handles[i].q.get())] = i
                if gone in done:
                    return
        finally:
            for get in gets:
                get.cancel()
            if gone is not None:
                gone.cancel()
            for h in handles:
                if not h.done:
                    loop.abort(h)

    async def handle(request: HttpRequest, chat: bool):
        try:
            parsed, hs = await accept(request, chat)
        except ApiError as e:
            return error(e)
        rid, texts = new_id(chat), [TextState(tok, parsed.stop) for _ in hs]
        if parsed.stream:
            return StreamingResponse(stream(parsed, hs, rid, texts, chat), media_type="text/event-stream")
        parts, logprobs, finish = [[] for _ in hs], [[] for _ in hs], ["abort"] * len(hs)
        async for i, event in events(hs, request):
            text = texts[i]
            if isinstance(event, Tokens) and not text.stopped:
                parts[i].append(text.add(event.ids))
                logprobs[i] += event.logprobs or []
                if text.stopped:   # a stop string: this choice is done
                    finish[i] = "stop"
                    loop.abort(hs[i])
            elif isinstance(event, Failed):
                return error(failure(event, parsed))
            elif isinstance(event, Shutdown):
                return error(ApiError(f"the server is shutting down: the request was cut after {len(text.ids)} "
                                      f"tokens (--shutdown-timeout)", None, 503, "service_unavailable"))
            elif isinstance(event, Finished) and not text.stopped:
                finish[i] = event.reason
        choices, used = [], 0
        for i, text in enumerate(texts):
            parts[i].append(text.finish())
            n = text.kept_tokens if text.stopped else len(text.ids)
            used += n
            lps = None if parsed.logprobs is None else (logprobs_chat if chat else logprobs_completion)(
                tok, logprobs[i][:n])
            choices.append(("".join(parts[i]), finish[i], lps))
        return JSONResponse(response(chat, rid, parsed.model, choices, usage(len(parsed.prompt_ids), used)))

    async def stream(parsed: Parsed, handles: list[Handle], rid: str, texts: list[TextState], chat: bool):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"
        if chat:
            for i in range(len(handles)):
                yield sse(chunk(True, rid, parsed.model, None, role=True, index=i))
        else:   # an SSE comment: the response starts now, even while the request waits for a slot
            yield ": spec-hal\n\n"
        finish = ["abort"] * len(handles)   # also when cut by shutdown (vLLM's finish_reason)

        def end(i: int):
            if tail := texts[i].finish():
                yield sse(chunk(chat, rid, parsed.model, tail, index=i))
            yield sse(chunk(chat, rid, parsed.model, None if chat else "", finish=finish[i], index=i))
        async for i, event in events(handles, None):
            text = texts[i]
            if isinstance(event, Tokens) and not text.stopped:
                delta = text.add(event.ids)
                logprobs = None
                if parsed.logprobs is not None and event.logprobs:
                    keep = event.logprobs[:max(0, text.kept_tokens - (len(text.ids) - len(event.ids)))] \
                        if text.stopped else event.logprobs
                    logprobs = (logprobs_chat if chat else logprobs_completion)(tok, keep)
                if delta or logprobs:
                    yield sse(chunk(chat, rid, parsed.model, delta, lp=logprobs, index=i))
                if text.stopped:
                    finish[i] = "stop"
                    loop.abort(handles[i])
            elif isinstance(event, Failed):   # this choice ends with its reason, then the error event
                finish[i] = "error"
                for line in end(i):
                    yield line
                yield sse(failure(event, parsed).body())
                yield "data: [DONE]\n\n"
                return
            elif not isinstance(event, Tokens):
                if isinstance(event, Finished) and not text.stopped:
                    finish[i] = event.reason
                for line in end(i):
                    yield line
        if parsed.include_usage:
            n = sum(t.kept_tokens if t.stopped else len(t.ids) for t in texts)
            yield sse(chunk(chat, rid, parsed.model, None, use=usage(len(parsed.prompt_ids), n)))
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions", response_class=JSONResponse, responses=_responses(CompletionResponse),
              summary="Create a completion")
    async def completions(request: HttpRequest):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", response_class=JSONResponse, responses=_responses(ChatCompletionResponse),
              summary="Create a chat completion")
    async def chat_completions(request: HttpRequest):
        return await handle(request, chat=True)

    @app.get("/v1/models", response_model=ModelList, summary="The served model")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                            "owned_by": "spec-hal", "max_model_len": max_model_len}]}

    @app.get("/health", response_model=Health, response_model_exclude_none=True, responses={503: {"model": Health}},
             summary="Liveness")
    async def health():
        if not loop.thread.is_alive():
            return JSONResponse({"status": "error", "reason": loop.error or "the engine loop stopped"}, 503)
        if loop.closing:
            return JSONResponse({"status": "error", "reason": "shutting down"}, 503)
        why = target.degraded
        return {"status": "ok"} if why is None else {"status": "degraded", "reason": why}

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def main(argv: list[str] | None = None) -> int:
    from hal.distributed.launcher import add_engine_args, bounded, start
    from hal.distributed.startup import Phases
    from hal.distributed.protocol import DRAFT
    parser = argparse.ArgumentParser(prog="spec-hal serve", description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=bounded(int, 0, 65535), default=8000,
                        help="the port to listen on (0: a free one, printed at start-up)")
    parser.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    parser.add_argument("--max-num-batched-tokens", type=bounded(int, 1),
                        help="tokens fed to the target per step (none: unbounded)")
    parser.add_argument("--max-num-seqs", type=bounded(int, 1), default=32, help="requests running at once")
    parser.add_argument("--max-model-len", type=bounded(int, 2), default=2048,
                        help="prompt + generated tokens per request")
    parser.add_argument("--max-queue-len", type=bounded(int, 0), default=256,
                        help="requests waiting beyond --max-num-seqs; past it: 503 with Retry-After")
    parser.add_argument("--shutdown-timeout", type=bounded(float, 0), default=10.0,
                        help="seconds in-flight requests get on SIGTERM; then streams end with finish_reason "
                             "'abort' and non-streaming requests get 503")
    args = parser.parse_args(argv)
    args.max_context = args.max_model_len
    phases = Phases("spec-hal serve")
    sock = None
    try:
        if int(os.environ.get("RANK", "0")) != DRAFT:   # the target serves HTTP: take the port first
            sock = bind(args.host, args.port)
            args.port = sock.getsockname()[1]   # --port 0: the one the system chose
            loading = LoadingResponder(sock)
            phases.say(f"listening on {args.host}:{args.port} (503 until ready)")
        target = start(args, args.max_num_seqs, {"max_num_batched_tokens": args.max_num_batched_tokens,
                                                 "max_num_seqs": args.max_num_seqs}, phases=phases)
        if target is None:   # the draft rank served until the target stopped
            return 0
        if target.tok is None:
            raise HalError(f"--model: expected a model with a tokenizer (GGUF), got {args.model}")
        app = make_app(target, args.served_model_name or args.model, args.max_model_len, args.k,
                       args.max_num_seqs + args.max_queue_len, args.shutdown_timeout)
    except HalError as e:
        print(f"spec-hal serve: {e}", file=sys.stderr)
        if sock is not None:
            loading.stop()
            sock.close()
        return 2
    phases.ready(f"http://{args.host}:{args.port}/v1 (model {args.served_model_name or args.model}, "
                 f"draft {args.draft}, k {args.k}{', routed' if args.route and args.draft != 'none' else ''})")
    # uvicorn re-raises the SIGTERM it handled once it has shut down; with this handler
    # in place that is a no-op, so a graceful stop exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    loading.stop()
    uvicorn_server(app, sock, args.shutdown_timeout).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
