"""The typed handoffs of one engine step (as vLLM's ``spec_decode/metadata.py``):

- `StepPlan`: what the scheduler decided (`hal.engine.scheduler.Scheduler`);
- `StepDrafts`: the drafts each decoding request verifies (`hal.engine.proposals.drafts_for`);
- `Lookahead`: a lookahead drafter's proposal for the next step;
- `StepReads`: everything the step reads back, device tensors until `read_back` turns them
  into flat host lists in one transfer;
- `StepResult`: what the execution (`hal.engine.execution.execute`) hands back to the engine,
  which alone changes request state.

Shapes: R decoding requests, N = sum(counts) drafts verified, K = max(counts), F requests
whose prefill completes with their first token, V the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from torch import Tensor

from hal.engine.forward import readback
from hal.engine.drafting import Proposal
from hal.engine.requests import State


@dataclass(eq=False)
class PrefillChunk:
    state: State
    num_tokens: int              # prompt tokens this step feeds into the KV
    completes: bool              # the chunk ends the (re)prefill: the request decodes from the next step


@dataclass
class StepPlan:
    """The scheduler's decision for one step."""

    decode: list[State]          # [R] running requests verified this step, in priority (arrival) order
    k: list[int]                 # [R] drafts allowed per decoding request (0: plain decoding)
    budget: int                  # tokens this step may feed the target
    prefill: list[PrefillChunk] = field(default_factory=list)  # sized once the drafts are known
    ahead: set | None = None     # decoding requests a lookahead drafter drafts the next step for (None: the greedy
                                 # ones and those drafted for now); a router's forecast of whom it asks next

    @property
    def first(self) -> list[State]:
        """Requests whose prefill completes now and that still need their first token."""
        return [c.state for c in self.prefill if c.completes and not c.state.generated]

    @property
    def resumed(self) -> list[State]:
        """Requests whose re-prefill (after preemption) completes now: they have their tokens."""
        return [c.state for c in self.prefill if c.completes and c.state.generated]


@dataclass
class StepDrafts:
    """The drafts verified this step, gathered on the target's device."""

    token_ids: Tensor               # [N] int64
    counts: list[int]               # [R] drafts each decoding request verifies
    probs: Tensor | None            # [N, V] the q each draft was drawn from; None: deterministic drafts
    parent_ids: Tensor | None       # [N] int64 local parents (a tree per row); None: chains
    shadow: list[tuple[int, int]]   # (decode index, flat slot) of an unverified first draft a router scores
    proposal: Proposal | None       # the drafter's proposal (where the shadow drafts are read)
    offsets_used: list[int]         # [R] Philox offsets the drafter spent per request (State.offset advances)
    passed_features: bool = False   # the drafter was passed every pending feature (State.features clears)
    asked: list[int] | None = None  # [R] drafts asked of the drafter this step, inline or ahead (None: nothing asked)
    host_ids: list[int] | None = None   # token_ids on the host, where a grammar read them (`hal.engine.grammar`)


@dataclass
class Lookahead:
    """A lookahead drafter's proposal for the next step, made before this step's readback."""

    proposal: Proposal
    rids: list[int]                 # the requests it drafted for
    caps: list[int]                 # slots per request (each request's k)
    first_slot: list[int]           # flat index of each request's first slot
    valid: list[int] | None = None  # leading slots worth verifying per request, once read back


@dataclass
class Logprobs:
    """Emitted tokens' logprobs: device tensors, or flat host lists after `read_back`."""

    logprob: Tensor | list            # [M] each emitted token's logprob under log_softmax(logits)
    top_values: Tensor | list | None  # [M, top_n] the best alternatives' logprobs
    top_ids: Tensor | list | None     # [M, top_n] and their ids


@dataclass
class StepReads:
    """Everything one step reads back (device tensors, or flat host lists after `read_back`)."""

    out: Tensor | list | None = None          # [R, K + 1] verified tokens (accepted drafts, then one more)
    accepted: Tensor | list | None = None     # [R] accepted drafts per request
    nodes: Tensor | list | None = None        # [R, K] the accepted path's nodes (trees), -1 padded
    logprobs: Logprobs | None = None          # the decoding rows' emitted tokens
    first: Tensor | list | None = None        # [F] first tokens of requests whose prefill completed
    first_logprobs: Logprobs | None = None
    shadow_scores: Tensor | list | None = None  # [G] fp32: a scored first draft's chance of acceptance
    lookahead_valid: Tensor | list | None = None  # [L] the lookahead proposal's num_valid
    dead: Tensor | list | None = None         # [N + R] verified rows left without any token by the processors
    first_dead: Tensor | list | None = None   # [F] the same for first-token rows (None: no processor is on)


def read_back(reads: StepReads) -> StepReads:
    """`reads` with every tensor (nested ones too) replaced by its flat host list, in the
    step's one device-to-host transfer (`hal.engine.forward.readback`)."""
    slots: list[tuple[object, str]] = []

    def collect(obj) -> None:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, Tensor):
                slots.append((obj, f.name))
            elif isinstance(value, Logprobs):
                collect(value)
    collect(reads)
    host = readback(*(getattr(obj, name) for obj, name in slots))
    copies: dict[int, object] = {}

    def rebuild(obj):
        changes = {}
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, Logprobs):
                changes[f.name] = rebuild(value)
        out = replace(obj, **changes)
        copies[id(obj)] = out
        return out
    result = rebuild(reads)
    for (obj, name), values in zip(slots, host):
        setattr(copies[id(obj)], name, values)
    return result


@dataclass
class StepResult:
    """What the execution of a `StepPlan` hands back to the engine."""

    reads: StepReads                  # host lists
    hidden: Tensor | None             # [T, H] the fed rows' hidden states (features: [T, F]); None: no forward
    fed: int                          # decode rows fed (R + N)
    top_n: int                        # top alternatives read per logprob row
    features: bool                    # ``hidden`` holds every fed row's features (a feature drafter)
    drafts: StepDrafts                # what was verified
    lookahead: Lookahead | None = None
    ahead_seconds: float = 0.0        # host time spent drafting the next step ahead (the next step's cost)
