"""The OpenAI wire format for `hal.server.app`: request bodies checked field by field (an
HTTP client is untrusted input: every error names the field), the chat template,
incremental detokenization with stop strings, and the response and chunk shapes."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field

from hal.checks import MAX_K
from hal.engine.requests import MAX_LOGPROBS, SamplingParams, TokenLogprob


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status``, a message naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.headers = message, param, status, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def _bad(param: str, expected: str, got) -> ApiError:
    got = repr(got) if not isinstance(got, str) or len(got) < 80 else repr(got[:80]) + "..."
    return ApiError(f"{param}: expected {expected}, got {got}", param)


def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name, default)
    if v is None and default is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _bad(name, f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]", v)
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise _bad(name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]", v)
    return float(v)


@dataclass
class Parsed:
    """A checked request: the prompt's token ids and the engine's parameters."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None        # top alternatives per token (None: no logprobs)
    model: str


def parse(body, *, chat: bool, tok, served: str, max_model_len: int, default_k: int,
          stop_ids: tuple[int, ...]) -> Parsed:
    """Check an OpenAI request body (completions or chat) and tokenize its prompt."""
    if not isinstance(body, dict):
        raise _bad("body", "a JSON object", type(body).__name__)
    model = body.get("model")
    if not isinstance(model, str) or model != served:
        raise ApiError(f"model: expected {served!r} (the model this server serves), got {model!r}", "model")
    if _int(body, "n", 1, 1) != 1:
        raise _bad("n", "1 (one choice per request)", body.get("n"))
    if chat:
        ids = tok.encode(render_chat(body.get("messages"))).ids
    else:
        ids = _prompt_ids(body.get("prompt"), tok)
    room = max_model_len - len(ids)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 1)
    if max_tokens is None:
        max_tokens = max(1, room) if chat else 16
    if len(ids) + max_tokens > max_model_len:
        raise ApiError(f"{name}: this model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{len(ids)} and {name} is {max_tokens} ({len(ids) + max_tokens} in all)", name)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise _bad("stop", "a non-empty string or a list of at most 16", body.get("stop"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", "a boolean", stream)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
        raise _bad("stream_options", "an object {include_usage: boolean}", so)
    if chat:
        lp = body.get("logprobs", False)
        if not isinstance(lp, bool):
            raise _bad("logprobs", "a boolean", lp)
        top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS) or 0
        logprobs = top if lp else None
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if body.get("echo"):
        raise _bad("echo", "false (echo is not supported)", body.get("echo"))
    spec = body.get("speculative") or {}
    if not isinstance(spec, dict):
        raise _bad("speculative", "an object such as {\"k\": 0}", spec)
    ignore_eos = body.get("ignore_eos", False)   # vLLM's extension: exactly max_tokens tokens (benchmarks)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos", "a boolean", ignore_eos)
    seed = _int(body, "seed", None, -(1 << 63), (1 << 63) - 1)
    top_k = _int(body, "top_k", 0, -1)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                            top_k=max(top_k, 0), top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                            seed=random.getrandbits(62) if seed is None else seed,
                            k=_int(spec, "k", default_k, 0, MAX_K), stop_ids=() if ignore_eos else tuple(stop_ids),
                            logprobs=logprobs)
    return Parsed(ids, params, stop, stream, so.get("include_usage", False), logprobs, model)


def _prompt_ids(prompt, tok) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str) and prompt:
        return tok.encode(prompt).ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt   # token ids: the engine checks their range
    raise _bad("prompt", "a non-empty string or list of token ids (one prompt)", prompt)


def render_chat(messages) -> str:
    """ChatML, as SmolLM2-Instruct's template renders it (its default system turn when none
    is given), ending with the assistant's turn."""
    from hal.models.tokenizer import DEFAULT_SYSTEM
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of {role, content}", messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise _bad(f"messages[{i}].role", "system, developer, user or assistant",
                       m.get("role") if isinstance(m, dict) else m)
        c = m.get("content")
        if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"),
                                                                                                      str)
                                       for p in c):
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise _bad(f"messages[{i}].content", "a string or a list of text parts", c)
        role = "system" if m["role"] == "developer" else m["role"]
        out.append(f"<|im_start|>{role}\n{c}<|im_end|>\n")
    if messages[0].get("role") not in ("system", "developer"):
        out.insert(0, f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


@dataclass
class TextState:
    """Incremental detokenization with stop strings (not included in the output, as
    OpenAI's): text is released once it cannot be the start of a stop string or the middle
    of a multi-byte character. Each step decodes only the tokens since the last complete
    character (vLLM's prefix/read offsets), not the whole output."""

    tok: object
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    text: str = ""          # the decoded text so far (complete characters)
    sent: int = 0           # characters of it released
    stopped: bool = False
    kept_tokens: int = 0    # tokens whose text reached the output (all of them unless a stop string cut it)
    _prefix: int = 0
    _read: int = 0

    def _decode(self) -> None:
        d = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        before, after = d(self.ids[self._prefix:self._read]), d(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def add(self, new: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += new
        self._decode()
        text = self.text
        hits = [i for i in (text.find(state, max(0, self.sent - len(state))) for state in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            self.stopped = True
            self.kept_tokens = self._tokens_for(cut)
            delta, self.sent = text[self.sent:cut], cut
            return delta
        self.kept_tokens = len(self.ids)
        safe = len(text) - (max(len(state) for state in self.stops) - 1 if self.stops else 0)
        delta = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self.tok.decode(self.ids, skip_special_tokens=True)   # whatever is left, incomplete bytes too
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def _tokens_for(self, chars: int) -> int:
        """The fewest tokens whose text reaches ``chars`` characters (their logprobs are kept)."""
        for n in range(1, len(self.ids) + 1):
            if len(self.tok.decode(self.ids[:n], skip_special_tokens=True)) >= chars:
                return n
        return len(self.ids)


def token_text(tok, i: int) -> str:
    return tok.decode([i], skip_special_tokens=False)


def logprobs_chat(tok, entries: list[TokenLogprob]) -> dict:
    def one(i, lp):
        s = token_text(tok, i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
                        for e in entries]}


def logprobs_completion(tok, entries: list[TokenLogprob], offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        s = token_text(tok, e.token)
        out["tokens"].append(s)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({token_text(tok, i): lp for i, lp in e.top})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response(chat: bool, rid: str, model: str, text: str, finish: str, lp: dict | None, use: dict) -> dict:
    choice = {"index": 0, "logprobs": lp, "finish_reason": finish}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk(chat: bool, rid: str, model: str, text: str | None, finish: str | None = None, lp: dict | None = None,
          role: bool = False, use: dict | None = None) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices if use is None else []}
    if use is not None:
        out["usage"] = use
    return out
