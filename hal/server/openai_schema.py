"""The OpenAI wire format for `hal.server.app`: request bodies validated against the
declared models of `hal.server.request_bodies` (an HTTP client is untrusted input: every error
names the field), the chat template,
incremental detokenization with stop strings, and the response and chunk shapes."""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass, field, replace

from pydantic import ValidationError

from hal.checks import MAX_K
from hal.engine.requests import SamplingParams, StructuredOutputs, TokenLogprob
from hal.models.chat_template import RenderedChat
from hal.server.request_bodies import WireModels, first_error


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status``, a message naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.headers = message, param, status, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


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
    n: int = 1                  # choices: sample i runs with `sample_params(i)`
    structured_field: str | None = None   # the field that set params.structured (error messages name it)

    def sample_params(self, i: int) -> SamplingParams:
        """Choice ``i``'s parameters: its own seed stream ``seed + i`` (vLLM's), wrapped to int64."""
        seed = (self.params.seed + i + (1 << 63)) % (1 << 64) - (1 << 63)
        return replace(self.params, seed=seed)


def parse(raw: bytes, *, chat: bool, tok, wire: WireModels, max_model_len: int, default_k: int,
          stop_ids: tuple[int, ...], template=None, content_tok=None) -> Parsed:
    """Validate an OpenAI request body (completions or chat) against the declared models
    (`hal.server.request_bodies`), tokenize its prompt and check it fits the context.
    ``template``: the model's `hal.models.chat_template.ChatTemplate` (None: chat is refused);
    ``content_tok``: as `encode_chat`'s (None: special tokens in message content are parsed)."""
    model = wire.chat if chat else wire.completion
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        raise ApiError(*reversed(first_error(e, model))) from None
    if chat:
        if template is None:
            raise ApiError("messages: expected a model with a chat template (tokenizer_config.json, "
                           "chat_template.jinja or the GGUF's tokenizer.chat_template), got one without; use "
                           "/v1/completions", "messages")
        ids, what = encode_chat(tok, template.render(chat_messages(body.messages)), content_tok), "messages"
    else:
        ids, what = _prompt_ids(body.prompt, tok), "prompt"
    if len(ids) >= max_model_len:
        raise ApiError(f"{what}: this model's maximum context length is {max_model_len} tokens; the prompt alone "
                       f"has {len(ids)}, leaving no room for a completion", what)
    name = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, name)
    if max_tokens is None:
        max_tokens = max_model_len - len(ids) if chat else min(16, max_model_len - len(ids))
    if len(ids) + max_tokens > max_model_len:
        raise ApiError(f"{name}: this model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{len(ids)} and {name} is {max_tokens} ({len(ids) + max_tokens} in all)", name)
    stop = [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if chat and body.top_logprobs and not body.logprobs:
        raise ApiError(f"top_logprobs: expected it only with logprobs: true, got {body.top_logprobs} with logprobs "
                       f"{body.logprobs}", "top_logprobs")
    if body.min_tokens and body.min_tokens > max_tokens:
        raise ApiError(f"min_tokens: expected at most {name} ({max_tokens}), got {body.min_tokens}", "min_tokens")
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    k = body.speculative.k if body.speculative is not None and body.speculative.k is not None else default_k
    top_k = body.top_k or 0
    params = SamplingParams(max_new_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                            top_k=max(top_k, 0), top_p=1.0 if body.top_p is None else body.top_p,
                            seed=random.getrandbits(62) if body.seed is None else body.seed,
                            k=min(k, MAX_K), stop_ids=() if body.ignore_eos else tuple(stop_ids), logprobs=logprobs,
                            **_processors(body, tok))
    field_, structured = _structured(body)
    if structured is not None:
        if body.ignore_eos:
            raise ApiError(f"ignore_eos: expected false with {field_} (a grammar ends with the stop token), got true",
                           "ignore_eos")
        if body.min_tokens:
            raise ApiError(f"min_tokens: expected 0 with {field_} (the grammar decides where the output ends), "
                           f"got {body.min_tokens}", "min_tokens")
        params = replace(params, structured=structured)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Parsed(ids, params, stop, bool(body.stream), include_usage, logprobs, body.model, body.n or 1, field_)


def _structured(body) -> tuple[str | None, StructuredOutputs | None]:
    """The one grammar a request asks for (OpenAI's ``response_format`` or vLLM's ``guided_*``)
    and the field it came from."""
    asked = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", StructuredOutputs(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        asked.append(("response_format.json_schema.schema", StructuredOutputs(json=json.dumps(rf.json_schema.schema_))))
    if body.guided_json is not None:
        asked.append(("guided_json", StructuredOutputs(json=json.dumps(body.guided_json))))
    if body.guided_regex is not None:
        asked.append(("guided_regex", StructuredOutputs(regex=body.guided_regex)))
    if body.guided_choice is not None:
        asked.append(("guided_choice", StructuredOutputs(choice=tuple(body.guided_choice))))
    if len(asked) > 1:
        raise ApiError(f"{asked[1][0]}: expected at most one of response_format (json), guided_json, guided_regex, "
                       f"guided_choice, got {', '.join(a for a, _ in asked)}", asked[1][0].split(".")[0])
    return asked[0] if asked else (None, None)


def _processors(body, tok) -> dict:
    """The logits processors' `SamplingParams` fields (unset: their neutral values)."""
    out = {}
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens", "min_p"):
        if getattr(body, name) is not None:
            out[name] = getattr(body, name)
    if body.logit_bias:
        out["logit_bias"] = {int(t): b for t, b in body.logit_bias.items()}
    if body.allowed_token_ids is not None:
        out["allowed_token_ids"] = tuple(body.allowed_token_ids)
    if body.bad_words:   # as vLLM: each word as tokenized, and as tokenized after a space
        out["bad_words"] = tuple(dict.fromkeys(tuple(encode(tok, w, False)) for word in body.bad_words
                                               for w in (word, " " + word.lstrip())))
    return out


def _prompt_ids(prompt, tok) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    return encode(tok, prompt) if isinstance(prompt, str) else list(prompt)


def encode(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``. ``encode_batch`` releases the GIL (``encode`` holds it: seconds
    for a prompt of megabytes, during which no other thread, the event loop's included, runs).
    ``add_special_tokens``: the tokenizer's own (a BOS its post-processor adds): a completion
    prompt gets them (as vLLM), a rendered chat not (its template writes them, as transformers)."""
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def text_tokenizer(tok):
    """A copy of ``tok`` that encodes special-token strings as the plain text they are
    (``encode_special_tokens``): what message content is encoded with by default."""
    from tokenizers import Tokenizer
    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    return plain


def encode_chat(tok, chat: RenderedChat, content_tok=None) -> list[int]:
    """Token ids of a rendered conversation. The template's own control tokens are control
    tokens; a message whose content holds a special token's string (``<|im_end|>``, say) has
    that content encoded by ``content_tok`` (`text_tokenizer`): as text, so a user cannot close
    their turn or forge another role's (OpenAI's behaviour). ``content_tok`` None: special tokens
    in content are parsed too (vLLM's). Content without such strings is encoded with the whole
    text, exactly as the template's text alone would be."""
    if content_tok is None:
        return encode(tok, chat.text, False)
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    if chat.contents is None:   # the template transforms content: where it lies is not known
        if any(sp in c for sp in specials for c in chat.message_contents):
            raise ApiError("messages: expected content without special-token text for this model (its chat "
                           "template transforms content, so such text cannot be kept as text), got some; the "
                           "server's --parse-special-tokens-in-content parses it instead", "messages")
        return encode(tok, chat.text, False)
    forged = [(a, b) for a, b in chat.contents if any(sp in chat.text[a:b] for sp in specials)]
    if not forged:
        return encode(tok, chat.text, False)
    pieces, at = [], 0   # (text, is content): the template's text around each forged content
    for a, b in forged:
        pieces += [(chat.text[at:a], False), (chat.text[a:b], True)]
        at = b
    pieces.append((chat.text[at:], False))
    ids = []
    for text, content in pieces:
        if text:
            ids += encode(content_tok if content else tok, text, False)
    return ids


def chat_messages(messages) -> list[dict]:
    """Validated messages (`hal.server.request_bodies`) or plain dicts of the same shape as the
    plain dicts a chat template reads: ``role`` (``developer`` as ``system``), ``content`` (text
    parts joined), and ``name`` where given."""
    out = []
    for m in messages:
        d = m if isinstance(m, dict) else {"role": m.role, "content": m.content, "name": m.name}
        c = d.get("content")
        if isinstance(c, list):
            c = "".join(p["text"] if isinstance(p, dict) else p.text for p in c)
        msg = {"role": "system" if d["role"] == "developer" else d["role"], "content": c or ""}
        if d.get("name") is not None:
            msg["name"] = d["name"]
        out.append(msg)
    return out


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


def response(chat: bool, rid: str, model: str, choices: list[tuple[str, str, dict | None]], use: dict) -> dict:
    """A whole response; ``choices``: (text, finish_reason, logprobs) per choice, in index order."""
    out = []
    for i, (text, finish, lp) in enumerate(choices):
        choice = {"index": i, "logprobs": lp, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        out.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": use}


def chunk(chat: bool, rid: str, model: str, text: str | None, finish: str | None = None, lp: dict | None = None,
          role: bool = False, use: dict | None = None, index: int = 0) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choices = [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}]
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": choices if use is None else []}
    if use is not None:
        out["usage"] = use
    return out
