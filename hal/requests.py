"""What flows through the engine: a `Request` (prompt + `SamplingParams`), its `State` in
flight, what one step returns (`StepOutput`), the `Drafter` interface, and the checks a
request passes before it is queued (untrusted input: an HTTP client, another process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from hal import kv
from hal.errors import HalError


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    k: int = 5
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None   # also return each emitted token's logprob and this many top alternatives


@dataclass
class SamplingParams:
    """Per-request parameters of `SpeculativeDecoder.add_request` (a `Request` without its prompt)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    k: int = 5
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None


MAX_LOGPROBS = 20


@dataclass
class StepOutput:
    """What one `SpeculativeDecoder.step` produced."""

    tokens: dict[int, list[int]] = field(default_factory=dict)   # new tokens per request id
    finished: list[int] = field(default_factory=list)            # ids finished (stop, length or abort)
    logprobs: dict[int, list[dict]] = field(default_factory=dict)  # per new token: token, logprob, top
    preempted: list[int] = field(default_factory=list)
    num_batched_tokens: int = 0                                   # tokens fed to the target this step


@dataclass
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
    req_k: int = 0  # drafts allowed this step: min(k, tokens left - 1)
    prefilled: int = 0       # tokens of ``tokens`` already in the KV during (re)prefill
    arrival: float = 0.0
    aborted: bool = False

    def next_offset(self) -> int:
        self.offset += 1
        return self.offset - 1


def draft_room(s) -> int:
    """Drafts a request may still take: a step emits accepted drafts + 1, never past max_new_tokens."""
    return s.req.max_new_tokens - len(s.generated) - 1


class Drafter(Protocol):
    """Proposes drafts for live requests; told what was accepted."""

    def propose(self, states: list[State]) -> tuple[list[list[int]], Tensor | None]:
        """Per request up to ``state.req.k`` draft tokens, and their draft distributions
        ``[N, V]`` (CSR order) or ``None`` for deterministic drafts."""

    def accepted(self, states: list[State], drafted: list[int], n_accepted: list[int]) -> None:
        """After verification: ``n_accepted[i]`` of ``drafted[i]`` drafts were kept."""

    def release(self, state: State) -> None:
        """The request finished."""


def check_request(req: Request, vocab: int, allocator: kv.BlockAllocator) -> None:
    """`HalError` naming the field unless ``req`` can run: token ids in ``[0, vocab)``, sane
    parameters, and prompt + new tokens + drafts within the whole KV pool (else it could
    never run, even alone)."""
    V = vocab
    if not req.prompt_ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V
                                 for t in req.prompt_ids):
        raise HalError(f"prompt_ids: expected at least one token id in [0, {V}), got "
                       f"{list(req.prompt_ids)[:8]}{'...' if len(req.prompt_ids) > 8 else ''}")
    for name, lo in (("max_new_tokens", 1), ("k", 0), ("top_k", -1), ("seed", -(1 << 63))):
        v = getattr(req, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or v >= 1 << 63:
            raise HalError(f"{name}: expected an int >= {lo}, got {v!r}")
    if not (isinstance(req.temperature, (int, float)) and 0 <= req.temperature < float("inf")):
        raise HalError(f"temperature: expected a finite float >= 0, got {req.temperature!r}")
    if not (isinstance(req.top_p, (int, float)) and 0 < req.top_p <= 1):
        raise HalError(f"top_p: expected a float in (0, 1], got {req.top_p!r}")
    if req.logprobs is not None and (isinstance(req.logprobs, bool) or not isinstance(req.logprobs, int)
                                     or not 0 <= req.logprobs <= MAX_LOGPROBS):
        raise HalError(f"logprobs: expected None or an int in [0, {MAX_LOGPROBS}], got {req.logprobs!r}")
    bs, nb = allocator.block_size, allocator.num_blocks
    need = -(-(len(req.prompt_ids) + req.max_new_tokens + req.k) // bs)
    if need > nb:  # it could never run, even alone: refuse rather than preempt forever
        raise HalError(f"prompt_ids + max_new_tokens: expected at most {nb * bs - req.k} tokens (the KV pool "
                       f"holds {nb} blocks of {bs}), got {len(req.prompt_ids) + req.max_new_tokens}")
