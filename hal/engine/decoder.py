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
``k = 0`` is plain decoding through the same path. A drafter's tree (``Proposal.parent_ids``)
goes through the same step: tree mask and depths in the forward, `verify_tree`, the accepted
path's KV compacted (`hal.engine.trees`).

Drafters get data (`hal.engine.requests.DraftBatch`) and return data (`hal.engine.requests.Proposal`,
on their own device); the step reads the device once, after verification (`hal.engine.forward.
readback`), and a lookahead drafter (n-gram) drafts the next step before that read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

import torch
from torch import Tensor

from hal import kv
from hal.engine import proposals as drafting, trees
from hal.errors import HalError
from hal.engine.forward import forward, forward_tokens, logprob_entry, logprob_rows, readback, sampling_args, target_probs
from hal.engine.history import HistoryBuffer
from hal.metrics import SpecDecodeMetrics
from hal.models.llama import Llama
from hal.devices import transfer
from hal.engine.requests import (MAX_LOGPROBS, DraftBatch, Drafter, Proposal, Request, SamplingParams, State, StepOutput,
                          check_request, draft_room)

__all__ = ["MAX_LOGPROBS", "DraftBatch", "Drafter", "Proposal", "Request", "SamplingParams", "SpeculativeDecoder",
           "State", "StepOutput", "draft_room", "forward", "sampling_args", "target_probs"]


class SpeculativeDecoder:
    """Continuous batching with an optional drafter on the same or another backend.

    With a `hal.engine.router.Router`, k is chosen per request and step (0 = plain decoding)
    before anything is drafted, inside the token budget; ``Request.k`` is then the cap.
    ``pool`` takes a KV pool from a `hal.engine.memory.Plan`. ``max_num_batched_tokens`` bounds
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
        self.history = HistoryBuffer(target.device)
        self._ahead: tuple[Proposal, dict[int, tuple[int, int]]] | None = None  # lookahead drafts: rid -> (slot, valid)
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
        self.history.add(rid, req.prompt_ids)
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
        live = self._fit(list(self.running), budget)
        out.k = {s.rid: s.req_k for s in live}
        out.num_batched_tokens = self._step(live, budget)
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
        s.seq, s.prefilled, s.features = self.pool.sequence(), 0, []
        if self.drafter is not None:
            self.drafter.release(s.rid)
        i = next((j for j, w in enumerate(self.waiting) if w.rid > s.rid), len(self.waiting))
        self.waiting.insert(i, s)   # priority (arrival) order
        self.preemptions += 1
        self.metrics.preemptions += 1
        self._out.preempted.append(s.rid)

    def _release(self, s: State) -> None:
        s.seq.free()
        self.history.release(s.rid)
        if self.drafter is not None:
            self.drafter.release(s.rid)
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

    def _finish_prefill(self, chunks: list[tuple[State, int]]) -> list[State]:
        """Commit the chunks; a request whose prompt is in goes to decoding. Returns those
        that still need their first token (fresh, not resumed after preemption)."""
        first = []
        for s, n in chunks:
            s.seq.commit(n)
            s.prefilled += n
            if s.prefilled == self._end(s):
                self.prefilling.remove(s)
                self.running.append(s)
                self.running.sort(key=lambda x: x.rid)
                if not s.generated:
                    first.append(s)
        return first

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

    # -- one step ----------------------------------------------------------------------------------

    def _step(self, live: list[State], budget: int) -> int:
        """One ragged target forward: the running requests' ``[last token, drafts...]`` (all
        rows verified) and the prefill chunks planned with the budget left (their last rows).
        Everything stays on the device until one readback. Returns the tokens fed."""
        be, dev = self.target.be, self.target.device
        ids, counts, q, guesses, prop, par = drafting.drafts_for(self.drafter, self.router is not None,
                                                                 self._ahead, self.history, live, dev)
        self._ahead = None
        fed = len(live) + sum(counts)
        pre = self._plan_prefill(budget - fed, self.pool.allocator.num_free - sum(
            self._blocks_for(s, 1 + c) for s, c in zip(live, counts)))
        if not live and not pre:
            return 0
        lens, host, pos = [1 + c for c in counts] + [n for _, n in pre], [], []
        for s, c in zip(live, counts):
            pos += range(len(host) + 1, len(host) + 1 + c)
            host += [s.tokens[-1]] + [0] * c
        for s, n in pre:
            host += s.tokens[s.prefilled:s.prefilled + n]
        tokens = torch.tensor(host, dtype=torch.long).to(dev)
        if pos:
            tokens[torch.tensor(pos).to(dev)] = ids
        ends = torch.tensor(lens).cumsum(0)
        rows = torch.cat([torch.arange(fed), ends[len(live):] - 1])
        layers = getattr(self.drafter, "features", None)   # the drafter reads every fed row's feature
        depth, mask = (None, None) if par is None else trees.layout(par, counts, [n for _, n in pre], dev)
        logits, hidden = forward_tokens(self.target, self.pool, [s.seq for s in live] + [s.seq for s, _ in pre],
                                        lens, tokens, rows=rows, feature_layers=layers or (),
                                        hidden_rows=None if layers is None else torch.arange(sum(lens)),
                                        tree_mask=mask, depth=depth)
        first = self._finish_prefill(pre)
        where = {s.rid: i for i, (s, _) in enumerate(pre)}
        reads: dict[str, Tensor] = {}
        lp_want = [s.req.logprobs or 0 for s in live + first if s.req.logprobs is not None]
        top_n = max(lp_want, default=0)
        if live:
            reads.update(trees.verify(be, live, counts, ids, q, logits[:fed], par))
            if par is not None:   # the accepted path's KV moves next to its root
                trees.compact(be, self.pool, [s.seq for s in live], counts, reads["nodes"])
            if lp_want:
                K1 = reads["out"].shape[1]
                flat = torch.tensor([i * K1 + j for i, c in enumerate(counts) for j in range(c + 1)]).to(dev)
                lrows = logits[:fed] if par is None else logits[:fed][trees.path_rows(reads["nodes"], counts, dev)
                                                                      .reshape(-1)[flat]]
                lp = logprob_rows(lrows, reads["out"].reshape(-1)[flat], top_n)
                reads.update(zip(("lp", "lp_top", "lp_ids"), lp))
            self.history.write([s.rid for s in live], [len(s.tokens) for s in live], reads["out"])
        if first:
            sel = torch.tensor([where[s.rid] for s in first]).to(dev)
            frows = logits[fed:][sel]
            tok, _ = be.sample(frows, *sampling_args(first, [1] * len(first), dev))
            reads["first"] = tok.long()
            if lp_want:
                reads.update(zip(("flp", "flp_top", "flp_ids"), logprob_rows(frows, tok, top_n)))
            self.history.write([s.rid for s in first], [len(s.tokens) for s in first], reads["first"][:, None])
        at = fed
        for j, (s, n) in enumerate(pre):
            at += n
            if layers is not None:
                s.features.append(hidden[at - n:at])
            elif s in self.running:
                s.last_hidden = hidden[fed + where[s.rid]]
        if guesses:
            g = torch.tensor([j for _, j in guesses]).to(prop.draft_token_ids.device)
            reads["hits"] = transfer(prop.draft_token_ids[g], dev) == reads["out"][[i for i, _ in guesses], 0]
        nxt = drafting.lookahead(self.drafter, self.history, live, first,
                                 [s for s, _ in pre if s in self.running and s not in first], reads.get("acc"), dev)
        if nxt is not None and isinstance(nxt[0].num_valid, Tensor):
            reads["valid"] = nxt[0].num_valid
        got = dict(zip(reads, readback(*reads.values())))   # the one host sync of the step
        self._commit(live, counts, guesses, got, hidden, top_n, layers is not None)
        for j, s in enumerate(first):
            lp = None
            if s.req.logprobs is not None:
                lp = [logprob_entry(got, "flp", j, int(got["first"][j]), s.req.logprobs, top_n)]
            self._emit(s, [int(got["first"][j])], lp)
        if nxt is not None:
            prop_next, (rids, caps, cu) = nxt
            valid = caps if prop_next.num_valid is None else drafting.valid_counts(
                got.get("valid", prop_next.num_valid), caps)
            self._ahead = (prop_next, {rid: (c, v) for rid, c, v in zip(rids, cu, valid)})
        return fed + sum(n for _, n in pre)

    def _commit(self, live, counts, guesses, got, hidden, top_n, features: bool = False) -> None:
        """Host bookkeeping of the verify result: KV lengths, metrics, router, drafter, emission."""
        if not live:
            return
        K1 = len(got["out"]) // len(live)
        out = [[int(t) for t in got["out"][i * K1:(i + 1) * K1]] for i in range(len(live))]
        n_acc = [int(a) for a in got["acc"]]
        self.metrics.observe(counts, n_acc, [s.rid for s in live])
        if self.drafter is not None:
            self.drafter.commit([s.rid for s in live], [len(s.tokens) + a for s, a in zip(live, n_acc)])
        if self.router is not None:
            self.router.observe(live, counts, n_acc)
            self.router.observe([live[i] for i, _ in guesses], [1] * len(guesses), [int(h) for h in got.get("hits", [])])
        row, K = 0, K1 - 1
        for i, s in enumerate(live):
            s.seq.commit(n_acc[i] + 1)
            path = range(row, row + n_acc[i] + 1) if "nodes" not in got else \
                [row] + [row + 1 + int(n) for n in got["nodes"][i * K:i * K + n_acc[i]]]
            if features:   # the rows that produced the accepted drafts and the bonus token
                s.features.append(hidden[list(path)])
            else:
                s.last_hidden = hidden[path[-1]]
            lp = None
            if s.req.logprobs is not None:
                lp = [logprob_entry(got, "lp", row + j, out[i][j], s.req.logprobs, top_n) for j in range(n_acc[i] + 1)]
            row += counts[i] + 1
            self._emit(s, out[i][: n_acc[i] + 1], lp)

    def profile_costs(self, max_tokens: int = 72, context: int = 512, reps: int = 5,
                      profile_draft: bool = True):
        """A `hal.engine.router.CostModel` measured here and now (`hal.engine.router.profile_decoder`)."""
        from hal.engine.router import profile_decoder
        return profile_decoder(self, max_tokens, context, reps, profile_draft)

