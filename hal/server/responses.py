"""The response bodies of `hal.server.app`, as published in ``/openapi.json`` (OpenAI's
shapes: completions, chat completions and their chunks' choices, logprobs, errors, the model
list, health). Requests are `hal.server.request_bodies`'s."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


Finish = Literal["stop", "length", "abort"]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Finish


class CompletionResponse(BaseModel):
    """The answer to a non-streaming completion (with ``stream``: ``text/event-stream`` of
    ``data: {...}`` chunks of this shape with ``finish_reason`` null until the last, then
    ``data: [DONE]``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class AssistantReply(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantReply
    logprobs: ChatLogprobs | None
    finish_reason: Finish


class ChatCompletionResponse(BaseModel):
    """The answer to a non-streaming chat completion (with ``stream``: ``text/event-stream``
    of ``chat.completion.chunk`` objects, then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer: OpenAI's error body, ``param`` naming the field at fault."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "degraded", "error", "loading"]
    reason: str | None = None
