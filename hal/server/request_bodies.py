"""The OpenAI wire format as declared models (pydantic): the request bodies the server
validates with (the response bodies are `hal.server.responses`). `hal.server.app`
publishes them in ``/openapi.json``, so the published schema is the validation.

Requests are strict (no coercion: ``"5"`` is not an integer) and closed (an unknown field
is a 400 naming it, never ignored). ``null`` means "unset" for every optional field, as
OpenAI and vLLM read it. Fields this server does not implement take only their neutral
value (``best_of: 1``, ``echo: false``, ``tools: []``, ...): anything else is refused.

The bounds that depend on the deployment (the served name, ``--max-model-len``, the
vocabulary) are part of the schema: `wire_models` builds the models for one server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field,
                      StringConstraints, Tag, ValidationError, WithJsonSchema)

from hal.checks import MAX_K
from hal.engine.requests import MAX_LOGPROBS

FLOAT32_TINY = 1.1754943508222875e-38   # the least positive normal float32: top_p below it is 0 in float32
INT32_MAX = (1 << 31) - 1               # top_k is an int32 in the engine's tensors
MAX_STOP = 16

# fields of OpenAI's API this server does not implement: only their neutral value is accepted
UNSUPPORTED = {
    "tools": "tool calling", "tool_choice": "tool calling", "parallel_tool_calls": "tool calling",
    "best_of": "best_of (server-side candidates)", "echo": "echo (the prompt in the output)",
    "suffix": "suffix (insertion)",
}
MAX_BAD_WORDS = 64



MAX_N = 16   # choices per request (each is a sequence in the engine)

class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


NonEmpty = Annotated[str, StringConstraints(min_length=1)]


def _integral(v):
    """JSON Schema's integer: ``7.0`` is one (strict pydantic would refuse it); ``"7"``,
    ``true`` and ``7.5`` are not."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def Int(**bounds):   # noqa: N802 (a type)
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


def _false(v: bool) -> bool:
    if v:
        raise ValueError("expected false")
    return v


OnlyFalse = Annotated[bool, AfterValidator(_false), WithJsonSchema({"type": "boolean", "const": False})]


class StreamOptions(Closed):
    include_usage: bool | None = None


class TextPart(Closed):
    type: Literal["text"]
    text: str


class TextFormat(Closed):
    type: Literal["text"]


class JsonObjectFormat(Closed):
    type: Literal["json_object"]


class JsonSchema(Closed):
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the output follows")
    strict: bool | None = None


class JsonSchemaFormat(Closed):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]
MAX_CHOICES = 64


Content = Union[str, list[TextPart]]


def _empty(v: list) -> list:
    if v:
        raise ValueError("expected an empty list (this server does not implement it)")
    return v


EmptyList = Annotated[list[Any], AfterValidator(_empty), WithJsonSchema({"type": "array", "maxItems": 0})]
Name = Annotated[str, StringConstraints(max_length=256)]


class SystemMessage(Closed):
    role: Literal["system", "developer"]
    content: Content
    name: Name | None = Field(None, description="the participant's name (passed to the model's chat template)")


class UserMessage(Closed):
    role: Literal["user"]
    content: Content
    name: Name | None = Field(None, description="the participant's name (passed to the model's chat template)")


class AssistantMessage(Closed):
    """An earlier answer, as the official client's ``ChatCompletionMessage.model_dump()`` sends
    it back: the fields this server never produces (``refusal``, ``audio``, ``function_call``,
    ``tool_calls``, ``annotations``) are accepted null or empty, and nothing else."""

    role: Literal["assistant"]
    content: Content | None = None
    name: Name | None = Field(None, description="the participant's name (passed to the model's chat template)")
    refusal: None = None
    audio: None = None
    function_call: None = None
    tool_calls: EmptyList | None = None
    annotations: EmptyList | None = None


def _role(m) -> str | None:
    role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
    return "system" if role in ("system", "developer") else role


Message = Annotated[Union[Annotated[SystemMessage, Tag("system")], Annotated[UserMessage, Tag("user")],
                          Annotated[AssistantMessage, Tag("assistant")]], Discriminator(_role)]


class _Common(Closed):
    """What completions and chat share (OpenAI's names; ``top_k``, ``ignore_eos`` and
    ``speculative`` are extensions, sent by the ``openai`` client in ``extra_body``)."""

    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(
        None, description="default 1; below 1e-5: greedy (vLLM's convention)")
    top_p: Annotated[float, Field(ge=FLOAT32_TINY, le=1)] | None = Field(
        None, description="default 1; at least the least positive normal float32 (the engine keeps float32)")
    top_k: Int(ge=-1, le=INT32_MAX) | None = Field(None, description="-1 or 0: off (default)")
    seed: Int(ge=-(1 << 63), le=(1 << 63) - 1) | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int(ge=1, le=MAX_N) | None = Field(None, description="choices to sample (each with seed + i; the prompt "
                                                              "is computed once)")
    ignore_eos: bool | None = Field(None, description="vLLM's extension: exactly max_tokens tokens")
    user: str | None = Field(None, description="an end-user label; it changes nothing")
    best_of: Int(ge=1, le=1) | None = None
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema (a grammar masks every verified row)")
    guided_json: dict[str, Any] | None = Field(None, description="vLLM's: a JSON schema the output follows")
    guided_regex: NonEmpty | None = Field(None, description="vLLM's: a regular expression the output matches")
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="vLLM's: the output is one of these strings")
    # logits processors (OpenAI's, then vLLM's extensions)
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(ge=1e-6, le=100)] | None = Field(
        None, description="vLLM's: > 1 discourages tokens of the prompt and the output")
    min_tokens: Int(ge=0, le=INT32_MAX) | None = Field(None, description="no stop token before this many")
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    bad_words: Annotated[list[NonEmpty], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="vLLM's: words never generated (each as tokenized, and after a space)")


@dataclass(frozen=True)
class WireModels:
    """The request models of one deployment."""

    completion: type[BaseModel]
    chat: type[BaseModel]


def below(n: int) -> str:
    """A regular expression for the decimal integers in ``[0, n)`` (no leading zeros):
    JSON Schema's way to bound an object's keys, here token ids."""
    top = str(n - 1)
    alts = ["0"] + [f"[1-9][0-9]{{{d - 1}}}" for d in range(1, len(top))]
    for i, c in enumerate(top):
        lo = 1 if i == 0 else 0
        if int(c) > lo:
            alts.append(f"{top[:i]}[{lo}-{int(c) - 1}][0-9]{{{len(top) - i - 1}}}")
    alts.append(top)
    return "^(" + "|".join(dict.fromkeys(a.replace("[0-9]{0}", "") for a in alts)) + ")$"


def wire_models(served: str, max_model_len: int, vocab: int, max_k: int) -> WireModels:
    """Request models whose bounds are this server's: the model name, ``max_tokens`` within
    ``max_model_len`` (a prompt has at least one token), token ids within ``vocab`` and
    ``speculative.k`` at most ``max_k`` (the server's ``--k``: its KV pools are planned for it)."""

    class Speculative(Closed):
        """spec-hal's extension: this request's speculation (``{"k": 0}``: plain decoding)."""

        k: Int(ge=0, le=min(max_k, MAX_K)) | None = Field(
            None, description="draft tokens per step, at most the server's --k (its default)")

    Model = Annotated[Literal[served], Field(description="the served model's name")]  # type: ignore[valid-type]
    MaxTokens = Int(ge=1, le=max(1, max_model_len - 1)) | None
    Ids = Annotated[list[Int(ge=0, le=vocab - 1)], Field(min_length=1)]
    Bias = Annotated[dict[Annotated[str, StringConstraints(pattern=below(vocab))],
                          Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300),
                     WithJsonSchema({"type": "object", "maxProperties": 300, "additionalProperties": False,
                                     "patternProperties": {below(vocab): {"type": "number", "minimum": -100,
                                                                          "maximum": 100}}})] | None

    class Processors(_Common):
        logit_bias: Bias = Field(None, description="token id (a string) -> a bias in [-100, 100] added to its logit")
        allowed_token_ids: Annotated[list[Int(ge=0, le=vocab - 1)], Field(min_length=1)] | None = Field(
            None, description="vLLM's: only these tokens may be generated")

    class CompletionRequest(Processors):
        model: Model
        speculative: Speculative | None = None
        prompt: NonEmpty | Ids | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)] | \
            Annotated[list[Ids], Field(min_length=1, max_length=1)] = Field(
                description="one prompt: text or token ids (a batch of one is accepted)")
        max_tokens: MaxTokens = Field(None, description="default 16")
        logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
        echo: OnlyFalse | None = None
        suffix: Literal[""] | None = None

    class ChatCompletionRequest(Processors):
        model: Model
        speculative: Speculative | None = None
        messages: Annotated[list[Message], Field(min_length=1)]
        max_tokens: MaxTokens = Field(None, description="default: the room left in the context")
        max_completion_tokens: MaxTokens = Field(None, description="OpenAI's newer name for max_tokens")
        logprobs: bool | None = None
        top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
        tools: Annotated[list[dict], Field(max_length=0)] | None = None
        tool_choice: Literal["none"] | None = None
        parallel_tool_calls: OnlyFalse | None = None

    return WireModels(CompletionRequest, ChatCompletionRequest)


ROLE_TAGS = {"system", "user", "assistant"}
FORMAT_TAGS = {"text", "json_object", "json_schema"}
UNION_MESSAGES = {
    "prompt": "a non-empty string or list of token ids (one prompt)",
    "stop": f"a non-empty string or a list of at most {MAX_STOP}",
    "content": "a string or a list of text parts",
}


def error_param(loc: tuple, fields: set[str]) -> str:
    """OpenAI's ``param`` for a pydantic error location: ``speculative.k``,
    ``messages[0].content`` (union and tag labels dropped; the path stops at a union)."""
    if loc and loc[0] in UNSUPPORTED:
        return loc[0]   # refused as a whole, whatever inside it is off
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ROLE_TAGS and i > 0 and isinstance(loc[i - 1], int):
            continue   # the discriminator's tag (messages[i].<role>.content)
        elif i == 1 and loc[0] == "response_format" and part in FORMAT_TAGS:
            continue   # response_format's tag (response_format.<type>.json_schema.name)
        elif part in fields:
            out += ("." if out else "") + part
        else:
            break      # a union member's label: report the field itself
    return out or "body"


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
          "less_than": ("<", "lt")}


def error_message(err: dict, param: str) -> str:
    """One line naming ``param``: what was expected and what arrived."""
    kind, leaf, got = err["type"], param.rsplit(".", 1)[-1].split("[")[0], _shown(err.get("input"))
    if kind == "json_invalid":
        return f"body: expected JSON, got a parse error ({err.get('ctx', {}).get('error', err['msg'])})"
    if leaf in UNSUPPORTED:
        return (f"{param}: not supported by this server ({UNSUPPORTED[leaf]}); expected null, leaving it out "
                f"or its neutral value, got {got}")
    if kind == "extra_forbidden":
        return f"{param}: expected no such field (not part of this API), got {got}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = _tag(err)
        got = err.get("input", {}).get(tag) if isinstance(err.get("input"), dict) else err.get("input")
        if tag == "type":
            return f"{param}: expected text, json_object or json_schema, got {_shown(got)}"
        return f"{param}: expected system, developer, user or assistant, got {_shown(got)}"
    if kind == "string_pattern_mismatch" and leaf == "logit_bias":
        return f"{param}: expected token ids as keys (decimal strings below the vocabulary size), got {got}"
    if kind in BOUNDS:
        op, key = BOUNDS[kind]
        return f"{param}: expected a value {op} {err['ctx'][key]!r}, got {got}"
    if _in_union(err) and kind.endswith("_type") and leaf in UNION_MESSAGES:
        return f"{param}: expected {UNION_MESSAGES[leaf]}, got {got}"
    return f"{param}: {err['msg'][0].lower() + err['msg'][1:]}, got {got}"


def _in_union(err: dict) -> bool:
    return any(isinstance(p, str) and ("[" in p or p in ("str", "constrained-str", "int", "list")) for p in err["loc"])


def _tag(err) -> str:
    """The field a discriminated union failed on: ``type`` (response_format) or ``role``
    (messages, whose discriminator is a function)."""
    tag = str(err.get("ctx", {}).get("discriminator", "role")).strip("'")
    return "role" if tag.endswith("()") else tag


def first_error(e: ValidationError, model: type[BaseModel]) -> tuple[str, str]:
    """(param, message) of the first thing wrong in a request body. Of a union's alternatives
    the most specific complaint is kept (deepest, then a bound over a type mismatch)."""
    errors = e.errors(include_url=False)
    top = errors[0]["loc"][:1]
    same = [err for err in errors if err["loc"][:1] == top]
    err = max(same, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type"))) if _in_union(errors[0]) \
        else errors[0]
    loc, fields = tuple(err["loc"]), field_names(model)
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc = (*loc, _tag(err))
    if err["type"] == "extra_forbidden":
        fields = fields | {loc[-1]}
    param = error_param(loc, fields)
    return param, error_message(err, param)


NESTED = {"k", "schema"} | set().union(*(m.model_fields for m in (
    StreamOptions, TextPart, TextFormat, SystemMessage, UserMessage, AssistantMessage, JsonSchema, JsonSchemaFormat)))


def field_names(model: type[BaseModel]) -> set[str]:
    """Every field name of ``model`` and the models nested in it."""
    return NESTED | set(model.model_fields)
