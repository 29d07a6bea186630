"""The HTTP routes of `hal.server.app`, each a few lines over `hal.server.service.Service`:
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``
and ``GET /metrics``."""


import time

from hal.server.openai_schema import ApiError
from hal.server.responses import ChatCompletionResponse, CompletionResponse, ErrorResponse, Health, ModelList


def documented(model) -> dict:
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


def error(e: ApiError):
    from fastapi.responses import JSONResponse
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def answer(service, request, chat: bool):
    """A completion request end to end: accepted, then streamed or answered whole."""
    from fastapi.responses import JSONResponse, StreamingResponse
    try:
        parsed, handles = await service.accept(request, chat)
        if parsed.stream:
            return StreamingResponse(service.stream(parsed, handles, chat), media_type="text/event-stream")
        return JSONResponse(await service.complete(request, parsed, handles, chat))
    except ApiError as e:
        return error(e)


def add_routes(app, service, served: str, metrics) -> None:
    """Register the routes on ``app`` (FastAPI) over ``service``; ``metrics``: the live ones."""
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @app.post("/v1/completions", response_class=JSONResponse, responses=documented(CompletionResponse),
              summary="Create a completion")
    async def completions(request: HttpRequest):
        return await answer(service, request, chat=False)

    @app.post("/v1/chat/completions", response_class=JSONResponse, responses=documented(ChatCompletionResponse),
              summary="Create a chat completion")
    async def chat_completions(request: HttpRequest):
        return await answer(service, request, chat=True)

    @app.get("/v1/models", response_model=ModelList, summary="The served model")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                            "owned_by": "spec-hal", "max_model_len": service.max_model_len}]}

    @app.get("/health", response_model=Health, response_model_exclude_none=True, responses={503: {"model": Health}},
             summary="Liveness")
    async def health():
        status, code = service.health()
        return status if code == 200 else JSONResponse(status, code)

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
