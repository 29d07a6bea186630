"""The speculative decoder: draft -> verify -> accept -> KV rollback, with continuous batching.

The request-level API is vLLM's engine shape: `SpeculativeDecoder.add_request`,
`abort`, `step` (one scheduling round, returning the new tokens and the finished
requests) and `has_unfinished`; `generate` is a thin loop over them.

Each step, under ``max_num_batched_tokens`` (prefill tokens + each running request's
last token + every draft token): running requests decode first, each feeding
``[last token, drafts...]`` in one ragged forward (the verify op keeps the accepted
prefix plus one token; rollback is free); the budget left prefills waiting requests,
in chunks. When KV blocks run out, drafts go first, then the latest-arrived running
request is preempted (its blocks freed, recomputed later from its tokens). A request's
randomness is a function of its own seed and step counter only, so its output does not
depend on what else runs, when it arrived, or whether it was chunked or preempted.
``k = 0`` is plain decoding through the same path.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

import torch
from torch import Tensor

from hal import kv
from hal.errors import HalError
from hal.metrics import SpecDecodeMetrics
from hal.models.llama import Batch, Llama
from hal.placement import transfer
from hal.requests import (MAX_LOGPROBS, Drafter, Request, SamplingParams, State, StepOutput, check_request,
                          draft_room)

__all__ = ["MAX_LOGPROBS", "Drafter", "Request", "SamplingParams", "SpeculativeDecoder", "State", "StepOutput",
           "draft_room", "forward", "sampling_args"]


def forward(model: Llama, pool: kv.KVPool, seqs: list[kv.Sequence], chunks: list[list[int]], all_rows: bool,
            tree_mask: Tensor | None = None, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Feed ``chunks[r]`` after each sequence's committed tokens (reserved, not committed).
    Returns logits and hidden states for every fed row (``all_rows``), each request's last,
    or the fed rows ``rows`` (flat indices) when given."""
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
    if rows is None:
        rows = torch.arange(int(qsl[-1])) if all_rows else qsl[1:] - 1
    batch = Batch(tokens=torch.tensor([t for c in chunks for t in c]).to(dev), positions=torch.tensor(positions).to(dev),
                  slot_mapping=torch.tensor(slots).to(dev), block_tables=kv.block_tables(seqs).to(dev),
                  seq_lens=torch.tensor([s.length + len(c) for s, c in zip(seqs, chunks)]).to(dev),
                  query_start_loc=qsl.to(dev), logits_rows=rows.to(dev))
    return model.forward(batch, pool.k, pool.v, tree_mask)


def sampling_args(states: list[State], repeats: list[int], dev, draw: bool = True) -> tuple[Tensor, ...]:
    """Per-row temperature, top-k, top-p, and (``draw``) seed and a fresh offset (one per
    request and call: only a call that draws spends an offset)."""
    rep = lambda vals, dt: torch.tensor([v for v, n in zip(vals, repeats) for _ in range(n)], dtype=dt).to(dev)  # noqa
    params = (rep([s.req.temperature for s in states], torch.float32), rep([s.req.top_k for s in states], torch.int32),
              rep([s.req.top_p for s in states], torch.float32))
    if not draw:
        return params
    offs = [s.next_offset() for s in states]
    return (*params, rep([s.req.seed for s in states], torch.long), rep(offs, torch.long))


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The target's p for verification: temperature, top-k and top-p applied, no draw spent
    (vLLM's ``compute_probs``; the same q the backends' `sample` returns, in plain torch)."""
    from verify_ops.sample import probs
    return probs(logits, temperature, top_k, top_p)[0]


class SpeculativeDecoder:
    """Continuous batching with an optional drafter on the same or another backend.

    With a `hal.router.Router`, k is chosen per request and step (0 = plain decoding)
    before anything is drafted, inside the token budget; ``Request.k`` is then the cap.
    ``pool`` takes a KV pool from a `hal.planner.Plan`. ``max_num_batched_tokens`` bounds
    the tokens one step feeds the target (None: unbounded); ``max_num_seqs`` the requests
    running at once."""

    def __init__(self, target: Llama, drafter: Drafter | None = None, num_blocks: int = 512, block_size: int = 16,
                 metrics: SpecDecodeMetrics | None = None, on_tokens=None, router=None, pool: kv.KVPool | None = None,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int = 256):
        self.target, self.drafter, self.on_tokens, self.router = target, drafter, on_tokens, router
        cfg = target.cfg
        self.pool = pool or kv.KVPool(target.be, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                                      num_layers=cfg.layers, device=target.device)
        self.metrics = metrics or SpecDecodeMetrics()
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise HalError(f"max_num_seqs: expected an int >= 1, got {max_num_seqs!r}")
        if max_num_batched_tokens is not None and (isinstance(max_num_batched_tokens, bool) or not isinstance(
                max_num_batched_tokens, int) or max_num_batched_tokens < max_num_seqs):
            raise HalError(f"max_num_batched_tokens: expected None or an int >= max_num_seqs ({max_num_seqs}) "
                           f"(every running request feeds at least one token), got {max_num_batched_tokens!r}")
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.steps, self.preemptions = 0, 0
        self.waiting: deque[State] = deque()    # new and preempted requests, in priority order
        self.prefilling: list[State] = []       # admitted, prompt partly in the KV
        self.running: list[State] = []          # decoding, in priority (arrival) order
        self._next_id, self._aborted, self._out = 0, [], StepOutput()
        self._t0 = time.perf_counter()

    # -- the request-level API ------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it joins at the next `step`. Returns its id."""
        return self.add(Request(list(prompt_ids), **asdict(params or SamplingParams())))

    def add(self, req: Request) -> int:
        """Queue a `Request` (prompt and parameters together); returns its id."""
        check_request(req, self.target.cfg.vocab, self.pool.allocator)
        rid, self._next_id = self._next_id, self._next_id + 1
        self.waiting.append(State(req, rid, list(req.prompt_ids), self.pool.sequence(),
                                  arrival=time.perf_counter() - self._t0))
        return rid

    def abort(self, rid: int) -> bool:
        """Stop request ``rid`` now and free its blocks (draft pool too); it is listed as
        finished by the next `step`. False if it is not in flight."""
        for queue in (self.waiting, self.prefilling, self.running):
            for s in queue:
                if s.rid == rid:
                    queue.remove(s)
                    s.done = s.aborted = True
                    self._release(s)
                    self._aborted.append(rid)
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def step(self) -> StepOutput:
        """One scheduling round: decode the running requests (drafts within the budget),
        then prefill waiting ones with the budget left. Returns what it produced."""
        self._out = out = StepOutput(finished=self._aborted)
        self._aborted = []
        budget = self.max_num_batched_tokens or 1 << 62
        out.num_batched_tokens = self._step(self._fit(list(self.running), budget), budget)
        for s in [s for s in self.running if s.done]:
            self.running.remove(s)
            self._release(s)
            out.finished.append(s.rid)
        self.steps += 1
        return out

    def generate(self, requests: list[Request]) -> list[list[int]]:
        """Generated token ids per request (stop token included when hit): add, step until done."""
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise HalError(f"requests[{i}].prompt_ids: expected at least one token, got none")
        ids = [self.add(r) for r in requests]
        got: dict[int, list[int]] = {rid: [] for rid in ids}
        try:
            while self.has_unfinished():
                for rid, toks in self.step().tokens.items():
                    got[rid] += toks
        finally:
            for rid in ids:
                self.abort(rid)
            self._aborted = []
        return [got[rid] for rid in ids]

    # -- scheduling --------------------------------------------------------------------------------

    def _blocks_for(self, s: State, n: int) -> int:
        return max(0, -(-(s.seq.length + n) // s.seq.block_size) - len(s.seq.blocks))

    def _fit(self, live: list[State], budget: int) -> list[State]:
        """Choose k, then shrink drafts to the token budget and to the free KV blocks; preempt
        the latest-arrived running requests while even k = 0 does not fit."""
        if not live:
            return live
        self._choose_k(live, budget)
        while sum(1 + s.req_k for s in live) > budget and any(s.req_k for s in live):
            max(live, key=lambda s: s.req_k).req_k -= 1
        while live and sum(self._blocks_for(s, 1 + s.req_k) for s in live) > self.pool.allocator.num_free:
            if any(s.req_k for s in live):
                for s in live:
                    s.req_k = 0
                continue
            # the latest arrival in flight goes: the earliest always progresses (it fits alone), so this ends
            victim = max(live + self.prefilling, key=lambda x: x.rid)
            if victim in live:
                live.remove(victim)
            self._preempt(victim)
        return live

    def _preempt(self, s: State) -> None:
        """Free a running request's blocks and requeue it first: it is recomputed from its
        tokens (everything but the last goes back into the KV; nothing is sampled again)."""
        (self.running if s in self.running else self.prefilling).remove(s)
        s.seq.free()
        s.seq, s.prefilled = self.pool.sequence(), 0
        if self.drafter is not None:
            self.drafter.release(s)
        i = next((j for j, w in enumerate(self.waiting) if w.rid > s.rid), len(self.waiting))
        self.waiting.insert(i, s)   # priority (arrival) order
        self.preemptions += 1
        self.metrics.preemptions += 1
        self._out.preempted.append(s.rid)

    def _release(self, s: State) -> None:
        s.seq.free()
        if self.drafter is not None:
            self.drafter.release(s)
        if self.router is not None:
            self.router.release(s)

    def _end(self, s: State) -> int:
        """Tokens a (re)prefill puts in the KV: the prompt, or all but the last of a resumed request."""
        return len(s.tokens) - (1 if s.generated else 0)

    def _plan_prefill(self, budget: int, free: int) -> list[tuple[State, int]]:
        """Admit waiting requests and size their prefill chunks within ``budget`` tokens and
        ``free`` blocks: ``[(state, tokens this step)]``."""
        # admit only what can finish its (re)prefill plus one token in blocks nobody has claimed yet
        claimed = sum(self._blocks_for(s, self._end(s) - s.prefilled + 1) for s in self.prefilling)
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_num_seqs:
            need = self._blocks_for(self.waiting[0], self._end(self.waiting[0]) + 1)
            if need > free - claimed:
                break
            claimed += need
            self.prefilling.append(self.waiting.popleft())
        chunks, bs = [], self.pool.allocator.block_size
        for s in self.prefilling:
            room = (len(s.seq.blocks) + free) * bs - s.seq.length
            n = min(self._end(s) - s.prefilled, budget, room)
            if n <= 0:
                break
            free -= self._blocks_for(s, n)
            budget -= n
            chunks.append((s, n))
        return chunks

    def _finish_prefill(self, chunks: list[tuple[State, int]], logits: Tensor, hidden: Tensor) -> None:
        """Commit the chunks (``logits``/``hidden``: each chunk's last row); a request whose
        prompt is in goes to decoding, a fresh one with its first token sampled."""
        first = []
        for i, (s, n) in enumerate(chunks):
            s.seq.commit(n)
            s.prefilled += n
            if s.prefilled == self._end(s):
                self.prefilling.remove(s)
                self.running.append(s)
                self.running.sort(key=lambda x: x.rid)
                s.last_hidden = hidden[i]
                if not s.generated:
                    first.append(i)
        if first:
            fs = [chunks[i][0] for i in first]
            rows = logits[first]
            tok, _ = self.target.be.sample(rows, *sampling_args(fs, [1] * len(fs), self.target.device))
            lp = self._logprobs(fs, rows, tok, [1] * len(fs))
            tok = tok.tolist()
            for j, s in enumerate(fs):
                self._emit(s, [tok[j]], lp[j] if lp else None)

    def _logprobs(self, states: list[State], rows: Tensor, tokens: Tensor, counts: list[int]):
        """Per state, per emitted row: the token's logprob under the target (log_softmax of its
        logits, as vLLM's raw logprobs) and its ``logprobs`` top alternatives; None if nobody asked."""
        want = [s.req.logprobs for s in states]
        if all(w is None for w in want):
            return None
        lsm = torch.log_softmax(rows.float(), -1)
        top_n = max(w or 0 for w in want)
        chosen = lsm.gather(1, tokens.long().clamp(min=0)[:, None])[:, 0].tolist()
        top = lsm.topk(top_n, -1) if top_n else None
        tv, ti = (top.values.tolist(), top.indices.tolist()) if top is not None else (None, None)
        out, r = [], 0
        for s, n in zip(states, counts):
            w = s.req.logprobs
            out.append(None if w is None else [
                {"token": int(tokens[r + j]), "logprob": chosen[r + j],
                 "top": list(zip(ti[r + j][:w], tv[r + j][:w])) if w else []} for j in range(n)])
            r += n
        return out

    def _emit(self, s: State, new: list[int], logprobs: list[dict] | None = None) -> None:
        n0 = len(s.generated)
        try:
            self._append(s, new)
        finally:
            now = time.perf_counter() - self._t0
            if n0 == 0 and s.generated:
                self.metrics.first_token(s.rid, now - s.arrival)
            if s.done:
                self.metrics.finished(s.rid, now - s.arrival, len(s.generated))
            if s.generated[n0:]:
                self._out.tokens.setdefault(s.rid, []).extend(s.generated[n0:])
                if logprobs is not None:
                    self._out.logprobs.setdefault(s.rid, []).extend(logprobs[:len(s.generated) - n0])
            if self.on_tokens is not None:
                self.on_tokens(s.rid, s.generated[n0:])

    def _append(self, s: State, new: list[int]) -> None:
        for t in new:
            s.generated.append(t)
            s.tokens.append(t)
            if t in s.req.stop_ids or len(s.generated) >= s.req.max_new_tokens:
                s.done = True
                return

    def _choose_k(self, live: list[State], budget: int | None = None) -> None:
        if self.drafter is None:
            ks = [0] * len(live)
        elif self.router is not None:
            ks = self.router.choose(live, budget=budget)
        else:  # never draft past max_new_tokens
            ks = [min(s.req.k, draft_room(s)) for s in live]
        for s, k in zip(live, ks):
            s.req_k = k

    def _step(self, live: list[State], budget: int) -> int:
        """One ragged target forward: the running requests' ``[last token, drafts...]`` (all
        rows verified) and the prefill chunks planned with the budget left (their last rows).
        Returns the tokens fed."""
        be, dev = self.target.be, self.target.device
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
        fed = sum(len(d) + 1 for d in drafts)
        pre = self._plan_prefill(budget - fed, self.pool.allocator.num_free - sum(
            self._blocks_for(s, len(d) + 1) for s, d in zip(live, drafts)))
        if not live and not pre:
            return 0
        chunks = [[s.tokens[-1]] + d for s, d in zip(live, drafts)] + [
            s.tokens[s.prefilled:s.prefilled + n] for s, n in pre]
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0)
        rows = torch.cat([torch.arange(fed), ends[len(live):] - 1])
        logits, hidden = forward(self.target, self.pool, [s.seq for s in live] + [s.seq for s, _ in pre], chunks,
                                 True, rows=rows)
        if pre:
            self._finish_prefill(pre, logits[fed:], hidden[fed:])
        if not live:
            return fed + sum(n for _, n in pre)
        logits, hidden = logits[:fed], hidden[:fed]
        ids, cu = torch.tensor([t for d in drafts for t in d], dtype=torch.long), torch.tensor(
            [0] + [len(d) for d in drafts]).cumsum(0)
        max_k = max(len(d) for d in drafts)
        if all(s.req.temperature == 0 for s in live):
            out, n_acc = be.verify_greedy(ids.to(dev), cu.to(dev), logits, max_k)
        else:  # mixed batches too: greedy rows get a one-hot p, which verifies exactly as greedy
            p = target_probs(logits, *sampling_args(live, [len(d) + 1 for d in drafts], dev, draw=False))
            seeds = torch.tensor([s.req.seed for s in live]).to(dev)
            offs = torch.tensor([s.next_offset() for s in live]).to(dev)
            out, n_acc = be.verify_rejection(ids.to(dev), cu.to(dev), None if q is None else transfer(q, dev), p, seeds,
                                             offs, max_k)
        lp = None
        if any(s.req.logprobs is not None for s in live):
            rows = torch.cat([torch.arange(c, c + int(n) + 1) for c, n in zip((cu[:-1] + torch.arange(len(live))).tolist(),
                                                                            n_acc.cpu().tolist())])
            emitted = torch.cat([out[i, :int(n_acc[i]) + 1] for i in range(len(live))])
            lp = self._logprobs(live, logits[rows.to(logits.device)], emitted, [int(n) + 1 for n in n_acc.cpu()])
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
            self._emit(s, out[i][: n_acc[i] + 1], lp[i] if lp else None)
        return row + sum(n for _, n in pre)

    def profile_costs(self, max_tokens: int = 72, context: int = 512, reps: int = 5,
                      profile_draft: bool = True):
        """A `hal.router.CostModel` measured here and now (`hal.router.profile_decoder`)."""
        from hal.router import profile_decoder
        return profile_decoder(self, max_tokens, context, reps, profile_draft)

