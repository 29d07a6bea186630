"""Loaded by the schemathesis run of tests/server/test_openapi.py (``SCHEMATHESIS_HOOKS``).

With its default checks, schemathesis expects every schema-valid request to be accepted.
One refusal of ours no JSON schema can express: a prompt that, once tokenized, leaves no
room for ``max_tokens`` within ``--max-model-len`` (OpenAI's and vLLM's 400
``context_length_exceeded``). schemathesis.toml therefore lets a 400 through its
positive-data check, and this stricter check takes its place: a schema-valid request may
be refused only for the context length, naming the prompt or ``max_tokens``. The other:
a grammar (``response_format``'s schema, ``guided_json``, ``guided_regex``) that is a valid
JSON value of its type but not a schema or regular expression llguidance compiles, two
grammars at once, or a grammar with ``ignore_eos`` / ``min_tokens``: a 400 naming that field.
And ``allowed_token_ids`` / ``bad_words`` that, as the answer runs, leave no token the
grammar (or each other) allows: a 400 naming them. And two cross-field bounds no schema of
ours states: ``min_tokens`` above ``max_tokens``, and ``top_logprobs`` without ``logprobs``."""

import schemathesis

CONTEXT_PARAMS = {"prompt", "messages", "max_tokens", "max_completion_tokens"}
GRAMMAR_PARAMS = ("response_format", "guided_json", "guided_regex", "guided_choice")


@schemathesis.check
def only_the_context_refuses_valid_data(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    err = response.json().get("error", {})
    param, message = err.get("param") or "", err.get("message", "")
    if param.startswith(GRAMMAR_PARAMS) or (param in ("ignore_eos", "min_tokens") and "grammar" in message):
        return None
    if param in ("allowed_token_ids", "bad_words") and "leave allowed, got none" in message:
        return None   # they exclude every token the grammar (or the other) needs, found as the answer runs
    if (param == "min_tokens" and "expected at most max_" in message) or \
            (param == "top_logprobs" and "only with logprobs: true" in message):
        return None   # a bound between two fields
    if err.get("param") not in CONTEXT_PARAMS or "maximum context length" not in err.get("message", ""):
        raise AssertionError(f"a schema-valid request was refused for something other than the context "
                             f"length: {err}")
    return None
