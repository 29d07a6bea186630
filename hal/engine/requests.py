"""What flows through the engine: a `Request` (prompt + `SamplingParams`), its `State` in
flight and what one step returns (`StepOutput`). What a drafter reads and returns is
`hal.engine.drafting`; the checks a request passes before it is queued, `hal.engine.validation`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from torch import Tensor

from hal import kv


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
    names: list[bytes] | None = None   # prefix-cache names of its leading blocks (`State.block_names`)
    matcher: object | None = None      # its grammar's matcher at the committed tokens (`hal.engine.grammar`)

    def next_offset(self) -> int:
        self.offset += 1
        return self.offset - 1

    def commit_tokens(self, new: list[int]) -> None:
        """Take ``new`` tokens in order, up to the first stop token or ``max_new_tokens`` (then ``done``)."""
        for t in new:
            self.generated.append(t)
            self.tokens.append(t)
            if t in self.req.stop_ids or len(self.generated) >= self.req.max_new_tokens:
                self.done = True
                return

    def prefill_end(self) -> int:
        """Tokens a (re)prefill puts in the KV: the prompt, or all but the last of a resumed request."""
        return len(self.tokens) - (1 if self.generated else 0)

    def block_names(self, block_size: int) -> list[bytes]:
        """The names (`hal.kv.block_hashes`) of the blocks a (re)prefill may take from the
        prefix cache, computed once per length of the tokens. A request always computes at
        least its last prefill token, so at most ``(prefill_end - 1) // block_size`` blocks."""
        stop = max(0, self.prefill_end() - 1) // block_size
        if self.names is None or len(self.names) != stop:
            self.names = kv.block_hashes(self.tokens, block_size, stop=stop)
        return self.names


def draft_room(s) -> int:
    """Drafts a request may still take: a step emits accepted drafts + 1, never past max_new_tokens."""
    return s.req.max_new_tokens - len(s.generated) - 1
