"""``--speculative-config``: vLLM's JSON form of the speculative settings, read onto ``--draft``
and ``--k`` (what a vLLM user types: ``--speculative-config '{"method": "dspark",
"num_speculative_tokens": 7}'``).

Keys (anything else is refused, naming the key; a key that spec-hal cannot honour is never
dropped silently):
- ``method``: a vLLM method spec-hal runs (``ngram``, ``eagle``, ``eagle3``, ``draft_model``,
  ``dspark``) or any ``--draft`` kind (``ngram+eagle``, ``eagle-tree``, ...); ``eagle3`` is the
  EAGLE head kind, whose loader reads both published layouts.
- ``num_speculative_tokens``: ``--k`` (the cap on k with routing on, the default; k itself with
  ``--no-route``).
- ``model``: the drafter's path (``draft_model``: required; the heads: a folder instead of the
  one shipped for the target).
- ``prompt_lookup_min`` / ``prompt_lookup_max``: accepted only as spec-hal's n-gram lookup runs
  them, 1 and 3, and only with an n-gram method.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hal.errors import HalError

ALIASES = {"eagle3": "eagle", "draft_model": "model"}          # vLLM method -> --draft kind
KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
NGRAM = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}       # hal.drafters.ngram's match lengths


@dataclass(frozen=True)
class SpeculativeConfig:
    draft: str          # a ``--draft`` value
    k: int | None       # ``--k``, or None to keep its default


def _bad(key: str, expected: str, got) -> HalError:
    return HalError(f"--speculative-config {key}: expected {expected}, got {got!r}", arg="--speculative-config",
                    expected=expected, got=repr(got))


def parse_speculative_config(text: str, max_k: int) -> SpeculativeConfig:
    """``text`` (a JSON object) as a ``--draft`` value and ``--k``; `HalError` naming the key that
    is unknown, missing or out of range. The draft path's existence is the caller's check."""
    from hal.drafters.kinds import KINDS
    try:
        cfg = json.loads(text)
    except ValueError:
        raise _bad("", "a JSON object", text) from None
    if not isinstance(cfg, dict):
        raise _bad("", "a JSON object", cfg)
    for key in cfg:
        if key not in KEYS:
            raise _bad("key", f"one of {', '.join(KEYS)}", key)
    methods = sorted(set(ALIASES) | set(KINDS) - {"none"})
    method = cfg.get("method")
    kind = ALIASES.get(method, method) if isinstance(method, str) else None
    if kind not in KINDS or kind == "none":
        raise _bad("method", f"one of {', '.join(methods)}", method)
    k = cfg.get("num_speculative_tokens")
    if k is not None and (type(k) is not int or not 0 <= k <= max_k):
        raise _bad("num_speculative_tokens", f"an int in [0, {max_k}]", k)
    for key, value in NGRAM.items():
        if key in cfg and (not kind.startswith("ngram") or cfg[key] != value):
            raise _bad(key, f"{value} with an n-gram method (spec-hal's lookup matches 1 to 3 tokens)", cfg[key])
    return SpeculativeConfig(_draft(kind, method, cfg.get("model")), k)


def _draft(kind: str, method: str, model) -> str:
    """The ``--draft`` value of ``kind`` (the config's ``method``) with the drafter's path ``model``."""
    from hal.drafters.kinds import KINDS
    if model is not None and not (isinstance(model, str) and model):
        raise _bad("model", "a path", model)
    argument = KINDS[kind].argument
    if argument == ":<path>" and model is None:
        raise _bad("model", f"the drafter's path with method {method!r}", None)
    if model is not None and argument not in (":<path>", "[:<path>]"):
        raise _bad("model", f"nothing with method {method!r} (it loads no drafter of its own)", model)
    return kind if model is None else f"{kind}:{model}"
