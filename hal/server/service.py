"""What the completion endpoints do, apart from the HTTP framework: check a request off the
event loop, queue one engine handle per choice (`hal.server.engine_loop`), and turn the engine's
events into a JSON body (`complete`) or an SSE stream (`stream`). The routes themselves are
`hal.server.routes`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from hal.engine.validation import check_request
from hal.errors import HalError
from hal.server.engine_loop import Busy, Closing, EngineLoop, Failed, Finished, Handle, Shutdown, Tokens
from hal.server.openai_schema import (ApiError, Parsed, TextState, chunk, logprobs_chat, logprobs_completion, new_id,
                                      parse, response, text_tokenizer, usage)
from hal.server.request_bodies import WireModels
from hal.server.transport import read_body

ENGINE_NAMES = {"prompt_ids": "prompt", "max_new_tokens": "max_tokens", "prompt_ids + max_new_tokens": "max_tokens"}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Service:
    """The completion endpoints over one engine loop: ``target`` (`hal.launch.start.Target`)
    gives the engine and its tokenizer, ``wire`` the request models."""

    def __init__(self, target, loop: EngineLoop, wire: WireModels, max_model_len: int, default_k: int,
                 max_in_flight: int, parse_special_in_content: bool = False):
        self.target, self.loop, self.wire = target, loop, wire
        self.dec, self.tok = target.dec, target.tok
        # message content is text (`hal.server.openai_schema.encode_chat`), unless the server was told otherwise
        self.content_tok = None if parse_special_in_content else text_tokenizer(self.tok)
        self.max_model_len, self.default_k, self.max_in_flight = max_model_len, default_k, max_in_flight

    # -- accepting a request --------------------------------------------------------------------

    def check(self, raw: bytes, chat: bool) -> Parsed:
        """Validate, tokenize and check against the engine: off the event loop (a prompt of
        megabytes takes seconds to tokenize)."""
        dec = self.dec
        parsed = parse(raw, chat=chat, tok=self.tok, wire=self.wire, max_model_len=self.max_model_len,
                       default_k=self.default_k, stop_ids=dec.target.cfg.stop_ids, template=self.target.template,
                       content_tok=self.content_tok)
        try:   # the engine's own checks (token ids, KV pool size), before the request is queued
            check_request(parsed.params.request(parsed.prompt_ids), dec.target.cfg.vocab, dec.pool.allocator)
        except HalError as e:
            name = str(e).split(":")[0]
            name = ENGINE_NAMES.get(name, name if name.isidentifier() else None)
            raise ApiError(str(e), "messages" if chat and name == "prompt" else name) from None
        if parsed.params.structured is not None:   # compile here, off the engine loop, to answer 400 now
            self._compile(parsed)
        return parsed

    def _compile(self, parsed: Parsed) -> None:
        field = parsed.structured_field
        if self.dec.grammar is None:
            raise ApiError(f"{field}: structured outputs need the llguidance package on the server "
                           "(pip install llguidance)", field.split(".")[0])
        try:
            self.dec.grammar.matcher(parsed.params.structured)
        except HalError as e:
            raise ApiError(f"{field}: {str(e).split(': ', 1)[-1]}", field) from None

    async def accept(self, request, chat: bool) -> tuple[Parsed, list[Handle]]:
        """The checked request and one engine handle per choice (all queued, or none)."""
        loop = self.loop
        if loop.closing:
            raise ApiError("the server is shutting down", None, 503, "service_unavailable")
        parsed = await asyncio.to_thread(self.check, await read_body(request), chat)
        if loop.failed:
            raise ApiError("the engine loop stopped", None, 503, "server_error")
        aio = asyncio.get_running_loop()
        handles = [Handle(replace(parsed, params=parsed.sample_params(i)), asyncio.Queue(), aio)
                   for i in range(parsed.n)]
        try:
            loop.submit_all(handles)
        except Busy:
            raise ApiError(f"server busy: {self.max_in_flight} requests in flight; retry later", None, 503,
                           "server_busy", {"Retry-After": "1"}) from None
        except Closing:
            raise ApiError("the server is shutting down", None, 503, "service_unavailable") from None
        return parsed, handles

    def health(self) -> tuple[dict, int]:
        """``({"status": ok | degraded | error, "reason": ...}, HTTP status)``."""
        loop = self.loop
        if not loop.thread.is_alive():
            return {"status": "error", "reason": loop.error or "the engine loop stopped"}, 503
        if loop.closing:
            return {"status": "error", "reason": "shutting down"}, 503
        why = self.target.degraded
        return ({"status": "ok"} if why is None else {"status": "degraded", "reason": why}), 200

    # -- the engine's events ----------------------------------------------------------------------

    @staticmethod
    def invalid(message: str, parsed: Parsed) -> ApiError:
        """A request its own parameters stopped (`StepOutput.errors`): a 400 naming the first."""
        name = message.split(":")[0]
        if name == "structured":
            name, message = parsed.structured_field, f"{parsed.structured_field}{message[len('structured'):]}"
        return ApiError(message, name if name.isidentifier() or "." in name else None)

    def failure(self, event: Failed, parsed: Parsed) -> ApiError:
        return self.invalid(event.message, parsed) if event.invalid else ApiError(event.message, None, 500,
                                                                                  "server_error")

    async def events(self, handles: list[Handle], request=None):
        """``(choice, event)`` until every choice has ended; with ``request``, ends early if
        the client goes away. Whatever way it ends, a choice still running is aborted."""
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
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
                    self.loop.abort(h)

    def logprobs_of(self, chat: bool, entries):
        """A choice's logprobs object (chat or completion shape) for ``entries``."""
        return (logprobs_chat if chat else logprobs_completion)(self.tok, entries)

    # -- the two answers --------------------------------------------------------------------------

    async def complete(self, request, parsed: Parsed, hs: list[Handle], chat: bool):
        """The whole answer as one body (`hal.server.openai_schema.response`), or the
        `ApiError` that ended it."""
        rid, texts = new_id(chat), [TextState(self.tok, parsed.stop) for _ in hs]
        parts, logprobs, finish = [[] for _ in hs], [[] for _ in hs], ["abort"] * len(hs)
        async for i, event in self.events(hs, request):
            text = texts[i]
            if isinstance(event, Tokens) and not text.stopped:
                parts[i].append(text.add(event.ids))
                logprobs[i] += event.logprobs or []
                if text.stopped:   # a stop string: this choice is done
                    finish[i] = "stop"
                    self.loop.abort(hs[i], "stop")
            elif isinstance(event, Failed):
                raise self.failure(event, parsed)
            elif isinstance(event, Shutdown):
                raise ApiError(f"the server is shutting down: the request was cut after {len(text.ids)} tokens "
                               "(--shutdown-timeout)", None, 503, "service_unavailable")
            elif isinstance(event, Finished) and not text.stopped:
                finish[i] = event.reason
        choices, used = [], 0
        for i, text in enumerate(texts):
            parts[i].append(text.finish())
            n = text.kept_tokens if text.stopped else len(text.ids)
            used += n
            lps = None if parsed.logprobs is None else self.logprobs_of(chat, logprobs[i][:n])
            choices.append(("".join(parts[i]), finish[i], lps))
        return response(chat, rid, parsed.model, choices, usage(len(parsed.prompt_ids), used))

    async def stream(self, parsed: Parsed, handles: list[Handle], chat: bool):
        """The answer as SSE lines: a role chunk per choice (chat) or a comment, the deltas,
        each choice's finish, usage where asked, then ``[DONE]``."""
        out = _Stream(self, parsed, handles, chat)
        for line in out.start():
            yield line
        async for i, event in self.events(handles):
            for line in out.on(i, event):
                yield line
            if out.failed:
                return
        for line in out.close():
            yield line


class _Stream:
    """One SSE answer's state: each choice's text, and how it finished."""

    def __init__(self, service: Service, parsed: Parsed, handles: list[Handle], chat: bool):
        self.s, self.parsed, self.handles, self.chat = service, parsed, handles, chat
        self.rid, self.texts = new_id(chat), [TextState(service.tok, parsed.stop) for _ in handles]
        self.finish = ["abort"] * len(handles)   # also when cut by shutdown (vLLM's finish_reason)
        self.failed = False

    def _chunk(self, delta, **kw) -> str:
        return sse(chunk(self.chat, self.rid, self.parsed.model, delta, **kw))

    def start(self):
        if self.chat:
            for i in range(len(self.handles)):
                yield self._chunk(None, role=True, index=i)
        else:   # an SSE comment: the response starts now, even while the request waits for a slot
            yield ": spec-hal\n\n"

    def end(self, i: int):
        if tail := self.texts[i].finish():
            yield self._chunk(tail, index=i)
        yield self._chunk(None if self.chat else "", finish=self.finish[i], index=i)

    def on(self, i: int, event):
        text = self.texts[i]
        if isinstance(event, Tokens):
            if not text.stopped:
                yield from self._tokens(i, event)
        elif isinstance(event, Failed):   # this choice ends with its reason, then the error event
            self.finish[i], self.failed = "error", True
            yield from self.end(i)
            yield sse(self.s.failure(event, self.parsed).body())
            yield "data: [DONE]\n\n"
        else:
            if isinstance(event, Finished) and not text.stopped:
                self.finish[i] = event.reason
            yield from self.end(i)

    def _tokens(self, i: int, event: Tokens):
        text = self.texts[i]
        delta, logprobs = text.add(event.ids), None
        if self.parsed.logprobs is not None and event.logprobs:
            keep = event.logprobs[:max(0, text.kept_tokens - (len(text.ids) - len(event.ids)))] \
                if text.stopped else event.logprobs
            logprobs = self.s.logprobs_of(self.chat, keep)
        if delta or logprobs:
            yield self._chunk(delta, lp=logprobs, index=i)
        if text.stopped:
            self.finish[i] = "stop"
            self.s.loop.abort(self.handles[i], "stop")

    def close(self):
        if self.parsed.include_usage:
            n = sum(t.kept_tokens if t.stopped else len(t.ids) for t in self.texts)
            yield self._chunk(None, use=usage(len(self.parsed.prompt_ids), n))
        yield "data: [DONE]\n\n"


async def _disconnected(request) -> None:
    """Returns once the client has gone (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
