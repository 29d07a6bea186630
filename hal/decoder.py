"""The speculative decoder: draft -> verify -> accept -> KV rollback, for a batch.

Each step every live request feeds ``[last token, drafts...]`` to the target in
one ragged forward; the verify op keeps the accepted prefix plus one token; the
target's KV keeps exactly the accepted positions (rollback is free: the rest is
overwritten next step). ``k = 0`` is plain decoding through the same path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from hal import kv
from hal.errors import HalError
from hal.metrics import SpecDecodeMetrics
from hal.models.llama import Batch, Llama
from hal.placement import transfer


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


def forward(model: Llama, pool: kv.KVPool, seqs: list[kv.Sequence], chunks: list[list[int]], all_rows: bool,
            tree_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Feed ``chunks[r]`` after each sequence's committed tokens (reserved, not committed).
    Returns logits and hidden states for every fed row (``all_rows``) or each request's last."""
    dev = model.device
    slots, positions = [], []
    for s, c in zip(seqs, chunks):
        sl, copies = s.reserve(len(c))
        if copies:
            src, dst = kv.block_copy_slots(copies, s.block_size)
            for kc, vc in zip(pool.k, pool.v):
                model.be.copy_kv(kc, vc, src.to(dev), dst.to(dev))
        slots += sl
        positions += range(s.length, s.length + len(c))
    lens = torch.tensor([len(c) for c in chunks])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    rows = torch.arange(int(qsl[-1])) if all_rows else qsl[1:] - 1
    batch = Batch(tokens=torch.tensor([t for c in chunks for t in c]).to(dev), positions=torch.tensor(positions).to(dev),
                  slot_mapping=torch.tensor(slots).to(dev), block_tables=kv.block_tables(seqs).to(dev),
                  seq_lens=torch.tensor([s.length + len(c) for s, c in zip(seqs, chunks)]).to(dev),
                  query_start_loc=qsl.to(dev), logits_rows=rows.to(dev))
    return model.forward(batch, pool.k, pool.v, tree_mask)


def sampling_args(states: list[State], repeats: list[int], dev) -> tuple[Tensor, ...]:
    """Per-row temperature, top-k, top-p, seed and a fresh offset (one per request and call)."""
    rep = lambda vals, dt: torch.tensor([v for v, n in zip(vals, repeats) for _ in range(n)], dtype=dt).to(dev)  # noqa
    offs = [s.next_offset() for s in states]
    return (rep([s.req.temperature for s in states], torch.float32), rep([s.req.top_k for s in states], torch.int32),
            rep([s.req.top_p for s in states], torch.float32), rep([s.req.seed for s in states], torch.long),
            rep(offs, torch.long))


class SpeculativeDecoder:
    """Batched generation with an optional drafter on the same or another backend.

    With a `hal.router.Router`, k is chosen per request and step (0 = plain decoding)
    before anything is drafted; ``Request.k`` is then the cap. ``pool`` takes a KV pool
    from a `hal.planner.Plan`."""

    def __init__(self, target: Llama, drafter: Drafter | None = None, num_blocks: int = 512, block_size: int = 16,
                 metrics: SpecDecodeMetrics | None = None, on_tokens=None, router=None, pool: kv.KVPool | None = None):
        self.target, self.drafter, self.on_tokens, self.router = target, drafter, on_tokens, router
        cfg = target.cfg
        self.pool = pool or kv.KVPool(target.be, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                                      num_layers=cfg.layers, device=target.device)
        self.metrics = metrics or SpecDecodeMetrics()
        self.steps = 0

    def generate(self, requests: list[Request]) -> list[list[int]]:
        """Generated token ids per request (stop token included when hit)."""
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise HalError(f"requests[{i}].prompt_ids: expected at least one token, got none")
        states = [State(r, i, list(r.prompt_ids), self.pool.sequence()) for i, r in enumerate(requests)]
        self._t0 = time.perf_counter()
        try:
            self._prefill(states)
            while live := [s for s in states if not s.done]:
                self._step(live)
        finally:
            for s in states:
                s.seq.free()
                if self.drafter is not None:
                    self.drafter.release(s)
                if self.router is not None:
                    self.router.release(s)
        return [s.generated for s in states]

    def _emit(self, s: State, new: list[int]) -> None:
        n0 = len(s.generated)
        try:
            self._append(s, new)
        finally:
            now = time.perf_counter() - self._t0
            if n0 == 0 and s.generated:
                self.metrics.first_token(s.rid, now)
            if s.done:
                self.metrics.finished(s.rid, now, len(s.generated))
            if self.on_tokens is not None:
                self.on_tokens(s.rid, s.generated[n0:])

    def _append(self, s: State, new: list[int]) -> None:
        for t in new:
            s.generated.append(t)
            s.tokens.append(t)
            if t in s.req.stop_ids or len(s.generated) >= s.req.max_new_tokens:
                s.done = True
                return

    def _prefill(self, states: list[State]) -> None:
        be = self.target.be
        logits, hidden = forward(self.target, self.pool, [s.seq for s in states], [s.tokens for s in states], False)
        tok, _ = be.sample(logits, *sampling_args(states, [1] * len(states), self.target.device))
        for i, s in enumerate(states):
            s.seq.commit(len(s.tokens))
            s.last_hidden = hidden[i]
            self._emit(s, [int(tok[i])])

    def _choose_k(self, live: list[State]) -> None:
        if self.drafter is None:
            ks = [0] * len(live)
        elif self.router is not None:
            ks = self.router.choose(live)
        else:  # never draft past max_new_tokens
            ks = [min(s.req.k, draft_room(s)) for s in live]
        for s, k in zip(live, ks):
            s.req_k = k

    def _step(self, live: list[State]) -> None:
        be, dev = self.target.be, self.target.device
        self._choose_k(live)
        # a free deterministic drafter also drafts for requests routed to k = 0; those drafts are
        # not verified, only scored against the emitted token (acceptance the router keeps learning)
        shadow = {s.rid for s in live if s.req_k == 0 and s.req.temperature == 0 and draft_room(s) > 0} if self.router is not None and getattr(self.drafter, "shadow", False) else set()
        for s in live:
            s.req_k = 1 if s.rid in shadow else s.req_k
        if any(s.req_k > 0 for s in live):
            drafts, q = self.drafter.propose(live)
        else:
            drafts, q = [[] for _ in live], None
        guesses = {}
        for i, s in enumerate(live):
            if s.rid in shadow:
                guesses[i], drafts[i], s.req_k = drafts[i][:1], [], 0
        ids, cu = torch.tensor([t for d in drafts for t in d], dtype=torch.long), torch.tensor(
            [0] + [len(d) for d in drafts]).cumsum(0)
        max_k = max(len(d) for d in drafts)
        logits, hidden = forward(self.target, self.pool, [s.seq for s in live],
                                 [[s.tokens[-1]] + d for s, d in zip(live, drafts)], True)
        if all(s.req.temperature == 0 for s in live):
            out, n_acc = be.verify_greedy(ids.to(dev), cu.to(dev), logits, max_k)
        else:
            _, p = be.sample(logits, *sampling_args(live, [len(d) + 1 for d in drafts], dev))
            seeds = torch.tensor([s.req.seed for s in live]).to(dev)
            offs = torch.tensor([s.next_offset() for s in live]).to(dev)
            out, n_acc = be.verify_rejection(ids.to(dev), cu.to(dev), None if q is None else transfer(q, dev), p, seeds,
                                             offs, max_k)
        out, n_acc = out.cpu().tolist(), n_acc.cpu().tolist()
        drafted = [len(d) for d in drafts]
        self.metrics.observe(drafted, n_acc, [s.rid for s in live])
        if self.drafter is not None:
            self.drafter.accepted(live, drafted, n_acc)
        if self.router is not None:
            self.router.observe(live, drafted, n_acc)
            scored = [i for i, g in guesses.items() if g]
            self.router.observe([live[i] for i in scored], [1] * len(scored),
                                [int(guesses[i][0] == out[i][0]) for i in scored])
        row = 0
        for i, s in enumerate(live):
            s.seq.commit(n_acc[i] + 1)
            s.last_hidden = hidden[row + n_acc[i]]
            row += len(drafts[i]) + 1
            self._emit(s, out[i][: n_acc[i] + 1])
        self.steps += 1

    def profile_costs(self, max_tokens: int = 72, context: int = 512, reps: int = 5,
                      profile_draft: bool = True):
        """A `hal.router.CostModel` measured here and now: the target forward over T fed
        tokens (T = 1, 2, 3, 5, 9, ... up to ``max_tokens``, at a short context), the
        extra cost of ``context`` tokens of attention, and the drafter's chain of k
        (``profile_draft=False``: not profiled, e.g. a remote drafter whose work overlaps)."""
        from hal.router import CostModel, profile
        bs = self.pool.allocator.block_size  # stay inside the pool the plan gave us
        room = (self.pool.allocator.num_free - 4) * bs
        max_tokens = max(1, min(max_tokens, room // 2 - 16))
        context = max(16, min(context, room - max_tokens - 64))
        seqs = [self.pool.sequence(), self.pool.sequence()]
        try:
            for q, n in zip(seqs, (16, 16 + context)):
                forward(self.target, self.pool, [q], [[1] * n], False)
                q.commit(n)
            fwd = lambda T, q=seqs[0]: forward(self.target, self.pool, [q], [[1] * T], True)  # noqa: E731
            verify = profile(fwd, [p for p in (1, 2, 3, 5, 9, 17, 33, 65, 129, 257) if p <= max_tokens], reps)
            # attention: the same 9-token verify at a short and a long context (a difference of two
            # noisy timings: a wide gap keeps it meaningful)
            n = min(9, max_tokens)
            long = profile(lambda _: forward(self.target, self.pool, [seqs[1]], [[1] * n], True), [1], reps)[1]
            short = profile(lambda _: forward(self.target, self.pool, [seqs[0]], [[1] * n], True), [1], reps)[1]
            per_context = max(0.0, long - short) / (n * context)
        finally:
            for q in seqs:
                q.free()
        draft = {}
        if self.drafter is not None and profile_draft:
            st = State(Request([1] * 16, k=1), -1, [1] * 16, seq=None)

            def chain(k):
                st.req_k = k
                self.drafter.propose([st])
            try:
                draft = profile(chain, [1, 2, 4, 8], reps)
            finally:
                self.drafter.release(st)
        return CostModel(verify, draft, per_context)
