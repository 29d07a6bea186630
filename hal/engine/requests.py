"""What flows through the engine: a `Request` (prompt + `SamplingParams`), its `State` in
flight, what one step returns (`StepOutput`), the `Drafter` interface, and the checks a
request passes before it is queued (untrusted input: an HTTP client, another process)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from typing import Protocol

import torch
from torch import Tensor

from hal import kv
from hal.errors import HalError


@dataclass(frozen=True)
class StructuredOutputs:
    """A grammar the output must follow (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, serialized), ``json_object`` (any JSON object), ``regex`` or
    ``choice`` (one of these strings). Compiled by `hal.engine.grammar.GrammarCompiler`."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request parameters of `SpeculativeDecoder.add_request` (a `Request` without its prompt)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    k: int = 5
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None   # also return each emitted token's logprob and this many top alternatives
    # logits processors (`hal.ops.Ops.process_logits`; vLLM's names and neutral defaults)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None          # token id -> added to its logit
    allowed_token_ids: tuple[int, ...] | None = None    # only these may be emitted
    bad_words: tuple[tuple[int, ...], ...] = ()         # token sequences never emitted
    min_tokens: int = 0                                 # no stop token before this many
    min_p: float = 0.0                                  # drop tokens below min_p x the top probability
    structured: StructuredOutputs | None = None         # the output follows this grammar (masks every verified row)

    def request(self, prompt_ids) -> "Request":
        """A `Request` of ``prompt_ids`` with these parameters (fields copied, not converted)."""
        return Request(list(prompt_ids), **{f.name: getattr(self, f.name) for f in fields(SamplingParams)})

    def processes_logits(self) -> bool:
        """Whether any logits processor is on."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.min_tokens or self.min_p)


@dataclass
class Request(SamplingParams):
    """A prompt and its `SamplingParams` (given by keyword): ``Request(ids, max_new_tokens=32)``."""

    prompt_ids: list[int]


MAX_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """An emitted token's logprob (vLLM's raw logprobs: log_softmax of the target's logits)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]   # the best alternatives: (token id, logprob), best first


@dataclass
class StepOutput:
    """What one `SpeculativeDecoder.step` produced."""

    tokens: dict[int, list[int]] = field(default_factory=dict)   # new tokens per request id
    finished: list[int] = field(default_factory=list)            # ids finished (stop, length or abort)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # per new token
    preempted: list[int] = field(default_factory=list)
    num_batched_tokens: int = 0                                   # tokens fed to the target this step
    k: dict[int, int] = field(default_factory=dict)              # drafts allowed per running request (router's k)
    errors: dict[int, str] = field(default_factory=dict)         # requests failed by their own parameters (also
    #                                                              in finished): why


@dataclass(eq=False)
class State:
    """A request in flight. ``tokens`` is the committed history; the target's KV holds
    all of it but the last token."""

    req: Request
    rid: int
    tokens: list[int]
    seq: kv.Sequence
    offset: int = 0
    generated: list[int] = field(default_factory=list)
    done: bool = False
    last_hidden: Tensor | None = None
    features: list[Tensor] = field(default_factory=list)  # target features not yet passed to the drafter
    prefilled: int = 0       # tokens of ``tokens`` already in the KV during (re)prefill
    arrival: float = 0.0
    aborted: bool = False
    names: list[bytes] | None = None   # prefix-cache names of its leading blocks (`hal.engine.prefix.names`)
    matcher: object | None = None      # its grammar's matcher at the committed tokens (`hal.engine.grammar`)

    def next_offset(self) -> int:
        self.offset += 1
        return self.offset - 1

    def prefill_end(self) -> int:
        """Tokens a (re)prefill puts in the KV: the prompt, or all but the last of a resumed request."""
        return len(self.tokens) - (1 if self.generated else 0)


def draft_room(s) -> int:
    """Drafts a request may still take: a step emits accepted drafts + 1, never past max_new_tokens."""
    return s.req.max_new_tokens - len(s.generated) - 1


@dataclass(frozen=True, kw_only=True)
class DraftBatch:
    """What a drafter reads: a read-only view of the requests to draft for, one row each.
    Drafters get data, never the engine's state."""

    rids: tuple[int, ...]
    params: tuple          # each request's sampling parameters (`SamplingParams` fields; do not modify)
    history: Tensor        # [R, L] int64 committed token ids (a copy of the engine's `hal.engine.history.HistoryBuffer`
    #                        rows); row i is valid up to num_tokens[i], scratch after
    num_tokens: Tensor     # [R] int64 committed lengths, on the history's device
    lengths: tuple[int, ...] | None  # the same on the host; None on a lookahead call (not known before the readback)
    k: tuple[int, ...]     # draft slots wanted per request
    offsets: tuple[int, ...]  # draft j of request i may draw with Philox (seed, offsets[i] + j)
    hidden: Tensor | None = None  # [R, H] the target's final hidden state at each request's last committed token
    features: Tensor | None = None  # [sum(num_features), F] for a drafter with ``features`` (an EAGLE head): the
    #                                 target's features not passed before, each request's rows in order, ending
    #                                 at the position that produced its last committed token (lengths[i] - 2)
    num_features: tuple[int, ...] = ()
    names: tuple[tuple[bytes, ...], ...] = ()  # per request: the target's prefix-cache names of its leading full
    #                                     blocks of prompt (`hal.kv.block_hashes` in blocks of names_block_size), so
    #                                     a drafter with its own pool may cache them too; () when the target does not
    names_block_size: int = 0


def pack_features(per_request: list[list[Tensor]]) -> tuple[Tensor | None, tuple[int, ...]]:
    """`DraftBatch.features` and ``num_features`` from each request's pending feature blocks."""
    flat = [f for blocks in per_request for f in blocks]
    return (torch.cat(flat) if flat else None), tuple(sum(len(f) for f in blocks) for blocks in per_request)


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """What a drafter returns: the op contract's CSR layout, on the drafter's device.

    Row i has exactly ``k[i]`` slots (so the scheduler knows every size without reading
    anything back). ``num_valid`` says how many leading slots are worth verifying (the
    rest are filler): an ``[R]`` int64 tensor, or None (all). A drafter that knows the counts
    on the host keeps the tensor there (reading it costs nothing); a lookahead drafter's may live
    on its device (the engine reads it with its one readback per step). A drafter whose drafts
    are random must not shorten them by looking at the draws (DSpark's counterexample).

    ``parent_ids`` makes each row a draft tree (`hal.ops.Ops.verify_tree`'s layout): slot j's
    local parent, -1 for a child of the root (the last committed token), parents before
    children, so any prefix of the slots is a tree too. Sampled requests verify a tree by
    exact multi-draft rejection: siblings must be deterministic (``draft_probs`` None) or
    i.i.d. draws from their q."""

    draft_token_ids: Tensor            # [N] int64
    cu_num_draft_tokens: Tensor        # [R + 1] int64
    draft_probs: Tensor | None = None  # [N, V] the q each draft was drawn from; None for deterministic drafts
    num_valid: Tensor | None = None      # [R] int64: leading slots worth verifying per row; None: all
    parent_ids: Tensor | None = None   # [N] int64: a tree per row (see above); None: chains


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a drafter may declare, as optional attributes of the same names (read only by
    `capabilities`)."""

    lookahead: bool = False
    """The drafter needs only device data (history, num_tokens), so the engine calls it right
    after verification, before its one host readback, with ``lengths=None`` and ``k`` = each
    request's cap; the next step verifies a prefix of those slots."""
    shadow: bool = False
    """Its drafts are free and deterministic: a router may have it draft one token for
    requests routed to k = 0 and score that draft against the emitted token."""
    features: tuple[int, ...] | None = None
    """Target layer indices: the drafter reads the target's features (`DraftBatch.features`),
    the residual streams entering those layers, concatenated, or for ``()`` the final normed
    hidden state. Each position's feature is passed once, in order, to the first `propose`
    after it was computed. None: no features."""


def capabilities(drafter) -> DrafterCapabilities:
    """A drafter's declared `DrafterCapabilities` (absent attributes take the defaults)."""
    if drafter is None:
        return DrafterCapabilities()
    features = getattr(drafter, "features", None)
    return DrafterCapabilities(bool(getattr(drafter, "lookahead", False)), bool(getattr(drafter, "shadow", False)),
                               None if features is None else tuple(features))


class Drafter(Protocol):
    """Proposes drafts for live requests from a `DraftBatch`. Optional attributes declare
    its `DrafterCapabilities` (``lookahead``, ``shadow``, ``features``)."""

    def propose(self, batch: DraftBatch) -> Proposal:
        """Drafts: exactly ``batch.k[i]`` slots for request i (see `Proposal`)."""

    def commit(self, rids: list[int], kept: list[int]) -> None:
        """After verification: the first ``kept[i]`` tokens of (the history request
        ``rids[i]`` was last drafted from + those drafts) are committed; anything a drafter
        cached beyond them is stale."""

    def release(self, rid: int) -> None:
        """The request finished, was aborted or preempted: drop what is kept for it."""


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < float("inf")


def _check_processors(req: Request, V: int) -> None:
    """The logits processors' parameters (`SamplingParams`), each `HalError` naming the field."""
    for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0),
                         ("repetition_penalty", 1e-6, 100.0), ("min_p", 0.0, 1.0)):
        v = getattr(req, name)
        if not (_finite(v) and lo <= v <= hi):
            raise HalError(f"{name}: expected a number in [{lo}, {hi}], got {v!r}")
    if isinstance(req.min_tokens, bool) or not isinstance(req.min_tokens, int) or not 0 <= req.min_tokens < 1 << 31:
        raise HalError(f"min_tokens: expected an int >= 0, got {req.min_tokens!r}")
    tok = lambda t: isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V  # noqa: E731
    if req.logit_bias is not None and not (isinstance(req.logit_bias, dict) and all(
            tok(t) and _finite(b) and -100 <= b <= 100 for t, b in req.logit_bias.items())):
        raise HalError(f"logit_bias: expected {{token id in [0, {V}): bias in [-100, 100]}}, got "
                       f"{str(req.logit_bias)[:80]}")
    if req.allowed_token_ids is not None and not (req.allowed_token_ids and all(tok(t) for t in req.allowed_token_ids)):
        raise HalError(f"allowed_token_ids: expected a non-empty list of token ids in [0, {V}), got "
                       f"{list(req.allowed_token_ids)[:8]}")
    if not all(isinstance(w, (tuple, list)) and w and all(tok(t) for t in w) for w in req.bad_words):
        raise HalError(f"bad_words: expected non-empty token id sequences in [0, {V}), got {list(req.bad_words)[:4]}")


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def check_request(req: Request, vocab: int, allocator: kv.BlockAllocator) -> None:
    """`HalError` naming the field unless ``req`` can run: token ids in ``[0, vocab)``, sane
    parameters, and prompt + new tokens + drafts within the whole KV pool (else it could
    never run, even alone)."""
    V = vocab
    if not req.prompt_ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V
                                 for t in req.prompt_ids):
        raise HalError(f"prompt_ids: expected at least one token id in [0, {V}), got "
                       f"{list(req.prompt_ids)[:8]}{'...' if len(req.prompt_ids) > 8 else ''}")
    for name, lo, hi in (("max_new_tokens", 1, 1 << 63), ("k", 0, 1 << 63), ("top_k", -1, 1 << 31),
                         ("seed", -(1 << 63), 1 << 63)):
        v = getattr(req, name)   # top_k: an int32 in the step's tensors
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or v >= hi:
            raise HalError(f"{name}: expected an int in [{lo}, {hi - 1}], got {v!r}")
    if not (isinstance(req.temperature, (int, float)) and 0 <= req.temperature < float("inf")):
        raise HalError(f"temperature: expected a finite float >= 0, got {req.temperature!r}")
    if not (isinstance(req.top_p, (int, float)) and 0 < req.top_p <= 1 and _float32(req.top_p) > 0):
        raise HalError(f"top_p: expected a float in (0, 1] that is not 0 in float32 (as the step keeps it), "
                       f"got {req.top_p!r}")
    if req.logprobs is not None and (isinstance(req.logprobs, bool) or not isinstance(req.logprobs, int)
                                     or not 0 <= req.logprobs <= MAX_LOGPROBS):
        raise HalError(f"logprobs: expected None or an int in [0, {MAX_LOGPROBS}], got {req.logprobs!r}")
    _check_processors(req, V)
    if req.structured is not None:
        if not isinstance(req.structured, StructuredOutputs):
            raise HalError(f"structured: expected None or StructuredOutputs, got {type(req.structured).__name__}")
        if not req.stop_ids:
            raise HalError("structured: expected stop_ids (a grammar ends with a stop token), got none "
                           "(ignore_eos cannot be combined with a grammar)")
        if req.min_tokens:
            raise HalError(f"min_tokens: expected 0 with structured outputs (the grammar decides where the output "
                           f"ends), got {req.min_tokens}")
    bs, nb = allocator.block_size, allocator.num_blocks
    need = -(-(len(req.prompt_ids) + req.max_new_tokens + req.k) // bs)
    if need > nb:  # it could never run, even alone: refuse rather than preempt forever
        raise HalError(f"prompt_ids + max_new_tokens: expected at most {nb * bs - req.k} tokens (the KV pool "
                       f"holds {nb} blocks of {bs}), got {len(req.prompt_ids) + req.max_new_tokens}")
