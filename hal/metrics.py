"""Speculative decoding counters, per request and global (as vLLM's SpecDecodingStats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable

from hal.errors import arg_error


@dataclass
class Counters:
    """``num_drafts`` counts verify steps that had at least one draft token."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)

    def add(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for name, n in (("accepted_per_position", accepted), ("drafts_per_position", k)):
            counts = getattr(self, name)
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        """P(draft j accepted | draft j proposed), per position j."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position + [0] * len(self.drafts_per_position),
                                                      self.drafts_per_position)]


class SpecDecodeMetrics:
    """Accumulates `Counters` globally and per request id."""

    def __init__(self) -> None:
        self.total = Counters()
        self.requests: dict[Hashable, Counters] = {}
        self.ttft: list[float] = []   # seconds from arrival to the first token, per finished request
        self.tpot: list[float] = []   # seconds per output token after the first, per finished request
        self.e2e: list[float] = []    # seconds from arrival to the last token
        self.draft_failures = 0       # the draft worker died or timed out; its requests fell back to plain decoding
        self.stale_drafts = 0         # drafts dropped because they were not built on the committed prefix
        self._first: dict[Hashable, float] = {}

    def first_token(self, request_id: Hashable, seconds: float) -> None:
        self._first[request_id] = seconds
        self.ttft.append(seconds)

    def finished(self, request_id: Hashable, seconds: float, num_tokens: int) -> None:
        first = self._first.pop(request_id, seconds)
        self.e2e.append(seconds)
        if num_tokens > 1:
            self.tpot.append((seconds - first) / (num_tokens - 1))

    def observe(self, num_draft_tokens: Iterable[int], num_accepted: Iterable[int],
                request_ids: Iterable[Hashable] | None = None) -> None:
        """Record one verify step of a batch (tensors or lists, one entry per request)."""
        ks = [int(v) for v in (num_draft_tokens.tolist() if hasattr(num_draft_tokens, "tolist") else num_draft_tokens)]
        acc = [int(v) for v in (num_accepted.tolist() if hasattr(num_accepted, "tolist") else num_accepted)]
        ids = list(request_ids) if request_ids is not None else list(range(len(ks)))
        if not (len(ks) == len(acc) == len(ids)):
            raise arg_error("num_accepted", f"one entry per request ({len(ks)})", f"{len(acc)} (ids: {len(ids)})")
        for rid, k, a in zip(ids, ks, acc):
            if not 0 <= a <= k:
                raise arg_error("num_accepted", f"0 <= accepted <= drafts ({k})", a)
            self.total.add(k, a)
            self.requests.setdefault(rid, Counters()).add(k, a)

    @property
    def acceptance_rate(self) -> float:
        return self.total.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        return self.total.mean_acceptance_length
