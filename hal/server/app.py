"""An OpenAI-compatible HTTP server with speculative decoding: ``spec-hal serve`` or
``python -m hal serve`` (under torchrun with a draft rank: ``torchrun --nproc-per-node 2
-m hal.server.app ...``; this process is then the target rank).

FastAPI + uvicorn. One engine loop (`EngineLoop`) runs `SpeculativeDecoder.step` in its
own thread; HTTP handlers talk to it through queues only, so a slow client never stalls
a step. Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, updated
every step), ``GET /openapi.json`` (the request and response bodies as declared models,
`hal.server.request_bodies`: the schema is the validation). The port is taken before anything
loads. A client that disconnects (streaming or not) is aborted and its KV blocks freed
(target and draft); past ``--max-num-seqs + --max-queue-len`` requests in flight the
answer is 503 with ``Retry-After``; SIGTERM stops accepting, lets in-flight requests
finish for up to ``--shutdown-timeout`` seconds, then ends each stream still running with
``finish_reason: "abort"`` and ``[DONE]`` (a non-streaming request gets a 503 JSON body),
and exits 0."""


import argparse
import os
import signal
import sys
from contextlib import asynccontextmanager

from hal.errors import HalError
from hal.host_threads import in_a_thread_that_ends
from hal.server.engine_loop import EngineLoop
from hal.server.loading import LoadingResponder
from hal.server.request_bodies import WireModels, wire_models
from hal.server.routes import add_routes
from hal.server.service import Service
from hal.server.transport import bind, uvicorn_server


def _openapi(app, wire: WireModels) -> dict:
    """FastAPI's document with the request bodies declared: the models the handlers
    validate with (`hal.server.request_bodies`)."""
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
             shutdown_timeout: float = 10.0, parse_special_in_content: bool = False):
    """The FastAPI app over a `hal.launch.start.Target` (engine + tokenizer): an engine loop
    (`hal.server.engine_loop`) started and stopped with the app, the routes (`hal.server.routes`)
    over a `hal.server.service.Service`."""
    from importlib.metadata import PackageNotFoundError, version

    from fastapi import FastAPI

    from hal.server.live_metrics import LiveMetrics
    dec = target.dec
    dec.metrics.bound(10_000)   # live figures go to prometheus; keep the in-process samples bounded
    metrics = LiveMetrics(max_k=max(default_k, 1))
    loop = EngineLoop(dec, metrics, max_in_flight, on_idle=target.on_idle)
    metrics.watch(dec, loop)
    wire = wire_models(served, max_model_len, dec.target.cfg.vocab, default_k)

    @asynccontextmanager
    async def lifespan(_app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()
            target.close()
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
    add_routes(app, Service(target, loop, wire, max_model_len, default_k, max_in_flight, parse_special_in_content),
               served, metrics)
    return app


def main(argv: list[str] | None = None) -> int:
    from hal.distributed.protocol import DRAFT
    from hal.launch.config import SERVE_BUDGET, LaunchConfig
    from hal.launch.flags import add_engine_args, bounded, nonempty
    from hal.launch.phases import Phases
    from hal.launch.start import start
    parser = argparse.ArgumentParser(prog="spec-hal serve", description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=bounded(int, 0, 65535), default=8000,
                        help="the port to listen on (0: a free one, printed at start-up)")
    parser.add_argument("--served-model-name", type=nonempty, help="the model name clients send (default: --model)")
    parser.add_argument("--max-num-batched-tokens", type=bounded(int, 1),
                        help="tokens fed to the target per step: long prompts are prefilled in chunks of what is "
                             "left after the running requests' tokens (default: chosen per device, printed at "
                             "start-up; 256 on a CPU)")
    parser.add_argument("--max-num-seqs", type=bounded(int, 1), default=32, help="requests running at once")
    parser.add_argument("--max-model-len", type=bounded(int, 2), default=2048,
                        help="prompt + generated tokens per request")
    parser.add_argument("--max-queue-len", type=bounded(int, 0), default=256,
                        help="requests waiting beyond --max-num-seqs; past it: 503 with Retry-After")
    parser.add_argument("--shutdown-timeout", type=bounded(float, 0), default=10.0,
                        help="seconds in-flight requests get on SIGTERM; then streams end with finish_reason "
                             "'abort' and non-streaming requests get 503")
    parser.add_argument("--parse-special-tokens-in-content", action="store_true",
                        help="parse special-token strings inside chat message content as the control tokens they "
                             "name (vLLM's behaviour); by default they are plain text, so no message can close its "
                             "turn or forge another role's")
    args = parser.parse_args(argv)
    phases = Phases("spec-hal serve")
    sock = None
    try:
        config = LaunchConfig.from_args(args, max_context=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                        max_num_batched_tokens=args.max_num_batched_tokens or SERVE_BUDGET)
        if int(os.environ.get("RANK", "0")) != DRAFT:   # the target serves HTTP: take the port first
            sock = bind(args.host, args.port)
            args.port = sock.getsockname()[1]   # --port 0: the one the system chose
            loading = LoadingResponder(sock)
            phases.say(f"listening on {args.host}:{args.port} (503 until ready)")
        # the target loads in a thread that ends, so that the engine loop's thread is the only one
        # with an OpenMP team (`hal.host_threads`); a draft rank loads in its own (see `start`)
        load = (lambda fn: fn()) if sock is None else in_a_thread_that_ends
        target = load(lambda: start(config, phases=phases))
        if target is None:   # the draft rank served until the target stopped
            return 0
        if target.tok is None:
            raise HalError(f"--model: expected a model with a tokenizer (GGUF), got {args.model}")
        app = make_app(target, args.served_model_name or args.model, args.max_model_len, args.k,
                       args.max_num_seqs + args.max_queue_len, args.shutdown_timeout,
                       args.parse_special_tokens_in_content)
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
    if app.state.loop.failed:
        print(f"spec-hal serve: the engine failed ({app.state.loop.error}); exiting", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
