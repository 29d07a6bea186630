"""Structured outputs: a request's grammar (`hal.engine.requests.StructuredOutputs`)
masks every row the target verifies, as one more logits processor (after
`hal.ops.Ops.process_logits`).

The grammar library is llguidance (`pip install llguidance`; measured against xgrammar on
this tokenizer in ``benchmarks/structured.py``). Each request keeps one matcher at its
committed tokens. For a step, each verified row's mask is the matcher's after the drafts on
that row's path (a chain's earlier drafts, or a tree node's ancestors): the drafts are
consumed, the mask taken, and the matcher rolled back to the committed tokens. A draft the
grammar forbids is masked to -inf at its row, so it is never accepted; the emitted tokens
are then consumed for good. Greedy output equals plain greedy decoding under the same
grammar, and a sampled token follows the masked target's law.

Deterministic chain drafts (n-gram lookup) are cut at the first token the grammar forbids
and extended with the tokens it forces (`constrain`), before the forward. Masks are computed on the host, so a step with a grammar
request reads its draft ids back (one transfer) before the forward; a step without one
costs nothing."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from torch import Tensor

from hal.engine.requests import State, StructuredOutputs
from hal.engine.step_types import StepDrafts
from hal.errors import HalError


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise HalError("structured outputs: expected the llguidance package (pip install llguidance), got none "
                       "installed") from None
    return llguidance


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer: ``tokenizer_json`` (a ``tokenizers``
    tokenizer serialized, ``Tokenizer.to_str()``), the model's ``vocab`` (rows of its logits)
    and its stop token ids (the grammar's end).

    Special tokens (the tokenizer's added tokens marked special: ``<|im_end|>``, ...) are never
    grammar text: llguidance matches a grammar's literal ``<|im_end|>`` to the special token,
    which a client's text must not reach (a stop token there would end the request mid-grammar).
    A grammar whose start forces one is refused at compile time (`matcher`); elsewhere the
    masks leave them out (`masks`), and a stop token is allowed only where the grammar is
    complete."""

    def __init__(self, tokenizer_json: str, vocab: int, stop_ids: tuple[int, ...]):
        if not stop_ids:
            raise HalError("GrammarCompiler stop_ids: expected at least one stop token id, got none")
        llg = _llguidance()
        self.vocab, self.stop_ids = vocab, tuple(stop_ids)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(stop_ids))
        added = json.loads(tokenizer_json).get("added_tokens") or []
        self.special_ids = tuple(sorted({int(a["id"]) for a in added if a.get("special") and 0 <= a["id"] < vocab}
                                        | set(self.stop_ids)))

    @staticmethod
    def grammar(spec: StructuredOutputs) -> tuple[str, str]:
        """(the field, the llguidance grammar) of ``spec``; `HalError` naming the field unless
        exactly one is set."""
        llg = _llguidance()
        if not isinstance(spec, StructuredOutputs):
            raise HalError(f"structured: expected StructuredOutputs, got {type(spec).__name__}")
        set_ = [name for name in ("json", "regex", "choice") if getattr(spec, name) is not None]
        set_ += ["json_object"] if spec.json_object else []
        if len(set_) != 1:
            raise HalError(f"structured: expected exactly one of json, json_object, regex, choice, got "
                           f"{set_ or 'none'}")
        name = set_[0]
        options = {"whitespace_flexible": False}   # compact JSON: no unbounded runs of whitespace
        if name == "json":
            try:
                schema = json.loads(spec.json)
            except (TypeError, ValueError) as e:
                raise HalError(f"structured.json: expected a JSON schema, got text that is not JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise HalError(f"structured.json: expected a JSON schema (an object), got {type(schema).__name__}")
            return name, llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if name == "json_object":
            return name, llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if name == "regex":
            if not isinstance(spec.regex, str) or not spec.regex:
                raise HalError(f"structured.regex: expected a non-empty regular expression, got {spec.regex!r}")
            return name, llg.LLMatcher.grammar_from_regex(spec.regex)
        if not spec.choice or not all(isinstance(c, str) and c for c in spec.choice):
            raise HalError(f"structured.choice: expected non-empty strings, got {list(spec.choice or [])[:4]}")
        return name, llg.LLMatcher.grammar_from_regex("|".join(_escape(c) for c in spec.choice))

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for ``spec``; `HalError` naming the field if the grammar is invalid
        or uses what llguidance does not support."""
        llg = _llguidance()
        name, grammar = self.grammar(spec)
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise HalError(f"structured.{name}: expected a grammar llguidance accepts, got: {first_line(error)}")
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise HalError(f"structured.{name}: expected a grammar llguidance accepts, got: "
                           f"{first_line(m.get_error())}")
        self._refuse_special_start(m, name)
        self._probe(m, name)
        return Matcher(m, self.special_ids, self.stop_ids)

    def _probe(self, m, name: str) -> None:
        """`HalError` naming the field when the grammar's lexer gives up within its first two
        tokens (a regex too big for it, ``a{1000000}``, compiles and fails only once text is
        matched): tried on a copy, with the last token each mask allows."""
        probe = m.deep_copy()
        for _ in range(2):
            ids = _allowed(probe, self.vocab).nonzero().flatten()
            if probe.is_error() or not len(ids) or not probe.consume_token(int(ids[-1])):
                break
            _allowed(probe, self.vocab)
        if probe.is_error():
            raise HalError(f"structured.{name}: expected a grammar llguidance can match, got one it gives up on "
                           f"once text is matched: {first_line(probe.get_error())}")

    def _refuse_special_start(self, m, name: str) -> None:
        """`HalError` naming the field when the grammar's start can only go on through a
        special token: every token it allows there is special, or its forced tokens hold one."""
        allowed = _allowed(m, self.vocab)
        ids = set(allowed.nonzero().flatten().tolist())
        forced = [t for t in m.compute_ff_tokens() if t in self.special_ids]
        if forced or (ids and ids <= set(self.special_ids)):
            token = forced[0] if forced else min(ids)
            raise HalError(f"structured.{name}: expected a grammar that plain text can satisfy, got one that "
                           f"needs special token {token} (special tokens such as <|im_end|> are never grammar text)")


def first_line(error: str) -> str:
    """llguidance's error without the parser state it appends (kept to one short line)."""
    return error.strip().split("\n")[0][:200]


class Matcher:
    """A request's llguidance matcher with the special tokens taken out of its masks: the
    ``special`` ids never, the ``stop`` ids only where the grammar is complete."""

    def __init__(self, matcher, special: tuple[int, ...], stop: tuple[int, ...]):
        self.m, self.special, self.stop = matcher, torch.tensor(special, dtype=torch.long), stop

    def allowed(self, V: int) -> Tensor:
        """``[V]`` bool: what may come next; only a stop token once the grammar is complete.
        Empty where the grammar is stuck (the row is then left without a token, and the request
        fails alone)."""
        if self.m.is_error():
            return torch.zeros(V, dtype=torch.bool)
        allowed = torch.zeros(V, dtype=torch.bool) if self.m.is_stopped() else _allowed(self.m, V)
        allowed[self.special[self.special < V]] = False
        if self.m.is_accepting():
            allowed[[t for t in self.stop if t < V]] = True
        return allowed

    # the llguidance matcher's own calls
    def validate_tokens(self, ids: list[int]) -> int:
        return self.m.validate_tokens(ids)

    def try_consume_tokens(self, ids: list[int]) -> int:
        return self.m.try_consume_tokens(ids)

    def consume_token(self, t: int) -> bool:
        return self.m.consume_token(t)

    def compute_ff_tokens(self) -> list[int]:
        return self.m.compute_ff_tokens()

    def rollback(self, n: int) -> None:
        self.m.rollback(n)

    def get_error(self) -> str:
        return self.m.get_error()


def _escape(text: str) -> str:
    """``text`` as a regular expression matching exactly it."""
    return "".join("\\" + c if c in r".^$*+?{}[]\|()/" else c for c in text)


def _allowed(matcher, V: int) -> Tensor:
    """``[V]`` bool: the tokens the matcher allows next."""
    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    words = -(-V // 32)
    unpacked = (bits[:words, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return unpacked.reshape(-1)[:V].bool()


def _row_paths(count: int, ids: list[int], parents: list[int] | None) -> list[list[int]]:
    """The draft tokens on each of a request's ``1 + count`` rows' paths: root, then a chain's
    prefixes or each tree node's ancestors and itself."""
    if parents is None:
        return [ids[:j] for j in range(count + 1)]
    paths: list[list[int]] = [[]]
    for j in range(count):
        paths.append((paths[1 + parents[j]] if parents[j] >= 0 else []) + [ids[j]])
    return paths


def constrain(states: list[State], drafts: StepDrafts, ks: list[int]) -> StepDrafts:
    """Deterministic chain drafts (n-gram lookup) under each request's grammar: cut at the
    first token the grammar forbids (that draft would be rejected, and what follows it is
    never reached), then extended with the tokens the grammar forces after them (llguidance's
    fast-forward tokens: a JSON key, its quotes and colon), up to the request's ``ks[i]``
    slots (the scheduler's budget). Forced tokens are the target's only choice, so they are
    accepted. Exact only because these drafts are deterministic: random drafts must not be
    shortened by looking at them (`hal.engine.drafting.Proposal`), so they are left alone.
    Reads the draft ids back once, only when a request has a grammar; they stay in
    ``host_ids`` for `masks`."""
    if drafts.probs is not None or drafts.parent_ids is not None or \
            not any(s.matcher is not None and k for s, k in zip(states, ks)):
        return drafts
    ids = drafts.token_ids.tolist()
    out, counts, at = [], [], 0
    for s, c, k in zip(states, drafts.counts, ks):
        mine, at = ids[at:at + c], at + c
        if s.matcher is not None and k:
            mine = mine[:s.matcher.validate_tokens(mine)]
            if len(mine) < k:
                n = s.matcher.try_consume_tokens(mine) if mine else 0
                forced = s.matcher.compute_ff_tokens() if n == len(mine) else []
                if n:
                    s.matcher.rollback(n)
                mine = mine + forced[:k - len(mine)]
        out += mine
        counts.append(len(mine))
    if counts == drafts.counts and out == ids:
        return replace(drafts, host_ids=ids)
    return replace(drafts, token_ids=torch.tensor(out, dtype=torch.long).to(drafts.token_ids.device), counts=counts,
                   host_ids=out)


def masks(states: list[State], counts: list[int], draft_ids: Tensor | None, parent_ids: Tensor | None, V: int,
          dev, host_ids: list[int] | None = None) -> Tensor | None:
    """``[sum(counts) + R, V]`` bool allowed tokens for the verified rows of ``states`` (their
    grammars after each row's drafts), or None when none of them has a grammar. Reads the
    draft ids back only then (unless `cut` has: ``host_ids``)."""
    if not any(s.matcher is not None for s in states):
        return None
    ids = host_ids if host_ids is not None else \
        draft_ids.tolist() if draft_ids is not None and draft_ids.numel() else []
    parents = parent_ids.tolist() if parent_ids is not None else None
    rows, at = [], 0
    for s, c in zip(states, counts):
        mine, pa = ids[at:at + c], None if parents is None else parents[at:at + c]
        at += c
        if s.matcher is None:
            rows.append(torch.ones(c + 1, V, dtype=torch.bool))
            continue
        for path in _row_paths(c, mine, pa):
            ok = s.matcher.try_consume_tokens(path) if path else 0
            # a path through a forbidden draft: that row is never used (the draft is rejected)
            rows.append((s.matcher.allowed(V) if ok == len(path) else torch.ones(V, dtype=torch.bool))[None])
            if ok:
                s.matcher.rollback(ok)
    return torch.cat(rows).to(dev)


def advance(state: State, tokens: list[int]) -> tuple[int, str | None]:
    """The committed ``tokens`` (emitted by the step) go into the request's matcher. Once the
    grammar is complete only a stop token is allowed, which ends the request. Returns how many
    it took, and why it refused the next one (that request alone then fails:
    `hal.engine.decoder.SpeculativeDecoder`), or None."""
    m = state.matcher
    for j, t in enumerate(tokens if m is not None else ()):
        if not m.consume_token(t):   # (consume_tokens refuses the stop token of a complete grammar)
            return j, f"structured: expected tokens the grammar allows, got token {t}, which it refused " \
                      f"({first_line(m.get_error())})"
    return len(tokens), None
