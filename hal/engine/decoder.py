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
path's KV compacted (`hal.engine.trees`). With prefix caching (on by default) every full block
of committed tokens is named in the target pool, and a request whose tokens start the same
prefills from its first uncached block (`hal.engine.prefix`); output is unchanged.

Drafters get data (`hal.engine.drafting.DraftBatch`) and return data (`hal.engine.drafting.Proposal`,
on their own device); the step reads the device once, after verification (`hal.engine.forward.
readback`), and a lookahead drafter (n-gram) drafts the next step before that read.
"""

from __future__ import annotations

import time

import torch

from hal import kv
from hal.engine import feature_cache, grammar, prefix, proposals
from hal.engine.grammar import GrammarCompiler
from hal.engine.execution import Offsets, execute
from hal.engine.forward import logprob_entry
from hal.engine.history import HistoryBuffer
from hal.engine.memory import target_pool
from hal.engine.drafting import Drafter, capabilities
from hal.engine.requests import Request, SamplingParams, State, StepOutput, TokenLogprob, draft_room
from hal.engine.validation import check_request
from hal.engine.scheduler import Scheduler, blocks_for
from hal.engine.step_types import PrefillChunk, StepDrafts, StepPlan, StepResult
from hal.errors import HalError
from hal.metrics import SpecDecodeMetrics
from hal.models.llama import Llama

__all__ = ["SpeculativeDecoder"]


class SpeculativeDecoder:
    """Continuous batching with an optional drafter on the same or another backend.

    With a `hal.engine.router.Router`, k is chosen per request and step (0 = plain decoding)
    before anything is drafted, inside the token budget; ``Request.k`` is then the cap.
    ``pool`` takes a KV pool from a `hal.engine.memory.Plan`. ``max_num_batched_tokens`` bounds
    the tokens one step feeds the target (None: unbounded); ``max_num_seqs`` the requests
    running at once. ``enable_prefix_caching``: None or True turns it on, False off; with a drafter
    that reads the target's features (an EAGLE head, the block drafter) the cached blocks' feature
    rows are kept too (`hal.engine.feature_cache`, at most ``feature_cache_bytes``).
    ``grammar`` compiles requests' `StructuredOutputs` (`hal.engine.grammar`; the tokenizer's)."""

    def __init__(self, target: Llama, drafter: Drafter | None = None, num_blocks: int = 512, block_size: int = 16,
                 metrics: SpecDecodeMetrics | None = None, on_tokens=None, router=None, pool: kv.KVPool | None = None,
                 max_num_batched_tokens: int | None = None, max_num_seqs: int = 256,
                 enable_prefix_caching: bool | None = None, grammar: GrammarCompiler | None = None,
                 feature_cache_bytes: int = feature_cache.CACHE_BYTES):
        self.target, self.drafter, self.on_tokens, self.router, self.grammar = target, drafter, on_tokens, router, grammar
        self.pool = pool or target_pool(target, num_blocks, block_size)
        self.metrics = metrics or SpecDecodeMetrics()
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise HalError(f"max_num_seqs: expected an int >= 1, got {max_num_seqs!r}")
        if max_num_batched_tokens is not None and (isinstance(max_num_batched_tokens, bool) or not isinstance(
                max_num_batched_tokens, int) or max_num_batched_tokens < max_num_seqs):
            raise HalError(f"max_num_batched_tokens: expected None or an int >= max_num_seqs ({max_num_seqs}) "
                           f"(every running request feeds at least one token), got {max_num_batched_tokens!r}")
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.pool.allocator.caching = self.prefix_caching = prefix.enabled(enable_prefix_caching)
        feature_cache.bound(feature_cache_bytes)
        a = self.pool.allocator
        self.drafter_caps = capabilities(drafter)   # read once: each step reads them
        self.cached_features = feature_cache.FeatureCache(a.block_size, a.num_blocks, feature_cache_bytes,
                                                          lambda name: bool(a.match([name]))) \
            if self.prefix_caching and self.drafter_caps.features is not None else None
        self.scheduler = Scheduler(a, max_num_seqs, max_num_batched_tokens, self._preempt,
                                   None if self.cached_features is None else self.cached_features.leading)
        self.steps, self._next_id, self._aborted, self._out = 0, 0, [], StepOutput()
        self.history = HistoryBuffer(target.device)
        self._ahead = None   # a lookahead drafter's proposal for the next step (`hal.engine.step_types.Lookahead`)
        self._ahead_s = 0.0  # seconds the last step spent drafting this one ahead
        self._t0 = time.perf_counter()

    preemptions = property(lambda self: self.metrics.preemptions,
                           doc="Requests preempted so far (counted once, in ``metrics.preemptions``).")

    waiting = property(lambda self: self.scheduler.waiting, doc="Requests not yet admitted (the scheduler's queue).")
    prefilling = property(lambda self: self.scheduler.prefilling, doc="Admitted requests, prompt partly in the KV.")
    running = property(lambda self: self.scheduler.running, doc="Decoding requests, in arrival order.")

    # -- the request-level API ------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it joins at the next `step`. Returns its id."""
        return self.add((params or SamplingParams()).request(prompt_ids))

    @torch.inference_mode()
    def add(self, req: Request) -> int:
        """Queue a `Request` (prompt and parameters together); returns its id. Nothing changes if it raises.
        Like every entry point that changes engine state (`step`, `abort`), it runs in inference mode:
        the tensors a step makes (and keeps: history, pools, drafters' state) may be updated in place here."""
        check_request(req, self.target.cfg.vocab, self.pool.allocator)
        matcher = None
        if req.structured is not None:
            if self.grammar is None:
                raise HalError("structured: expected a decoder built with a grammar compiler "
                               "(SpeculativeDecoder(grammar=GrammarCompiler(...))), got none")
            matcher = self.grammar.matcher(req.structured)
        rid = self._next_id
        state = State(req, rid, list(req.prompt_ids), self.pool.sequence(), arrival=time.perf_counter() - self._t0,
                      matcher=matcher)
        self.history.add(rid, req.prompt_ids)   # the last step that can fail: then it is queued
        self.scheduler.add(state)
        self._next_id += 1
        return rid

    @torch.inference_mode()
    def abort(self, rid: int) -> bool:
        """Stop request ``rid`` now and free its blocks (draft pool too); it is listed as
        finished by the next `step`. False if it is not in flight."""
        state = self.scheduler.find(rid)
        if state is None:
            return False
        self.scheduler.remove(state)
        state.done = state.aborted = True
        self._release(state)
        self._aborted.append(rid)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> StepOutput:
        """One scheduling round: decode the running requests (drafts within the budget), then prefill waiting
        ones with the budget left. Returns what it produced. In inference mode (benchmarks/inference_mode.py):
        the tensors it makes are updated in place only inside a step."""
        self._out = StepOutput(finished=self._aborted)
        self._aborted, t0 = [], time.perf_counter()
        plan = self.scheduler.schedule(self._choose_k)
        result = self._execute(plan)
        out = self._postprocess(plan, result)
        if self.router is not None and result is not None:   # what a decode step with (or without) drafts costs
            counts, ahead = result.drafts.counts, result.ahead_seconds   # drafting ahead: the next step's cost
            took, self._ahead_s = time.perf_counter() - t0 - ahead + self._ahead_s, ahead
            if not plan.prefill:   # a prefill chunk's cost is beyond the profiled counts: it would skew the ratios
                self.router.observe_step(result.fed, sum(counts), max(counts, default=0), took, len(result.drafts.shadow))
        return out

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[list[int]]:
        """Generated token ids per request (stop token included when hit): add, step until done."""
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise HalError(f"requests[{i}].prompt_ids: expected at least one token, got none")
        ids = [self.add(r) for r in requests]
        got: dict[int, list[int]] = {rid: [] for rid in ids}
        errors: dict[int, str] = {}
        try:
            while self.has_unfinished():
                out = self.step()
                errors.update(out.errors)
                for rid, toks in out.tokens.items():
                    got[rid] += toks
        finally:
            for rid in ids:
                self.abort(rid)
            self._aborted = []
        if errors:
            raise HalError(f"requests[{ids.index(min(errors))}]: {errors[min(errors)]}")
        return [got[rid] for rid in ids]

    def profile_costs(self, max_tokens: int = 72, context: int = 512, reps: int = 5,
                      profile_draft: bool = True, progress: bool = False):
        """A `hal.engine.costs.CostModel` measured here and now in this engine's pool
        (`hal.engine.costs.profile_costs`)."""
        from hal.engine.costs import profile_costs
        return profile_costs(self.target, self.drafter, self.pool, max_tokens, context, reps, profile_draft, progress)

    # -- scheduling callbacks ----------------------------------------------------------------------

    def _choose_k(self, live: list[State], budget: int) -> list[int]:
        if self.drafter is None:
            return [0] * len(live)
        if self.router is not None:
            return list(self.router.choose(live, budget=budget))
        return [min(s.req.k, draft_room(s)) for s in live]   # never draft past max_new_tokens

    def _preempt(self, state: State) -> None:
        """Free a request's blocks and requeue it first: it is recomputed from its tokens
        (everything but the last goes back into the KV; nothing is sampled again)."""
        self.scheduler.remove(state)
        state.seq.free()
        state.seq, state.prefilled, state.features = self.pool.sequence(), 0, []
        self._forget(state)
        self.scheduler.requeue(state)
        self.metrics.preemptions += 1
        self._out.preempted.append(state.rid)

    def _forget(self, state: State) -> None:
        """The drafter's and the feature cache's per-request state goes (preempted or finished)."""
        if self.drafter is not None:
            self.drafter.release(state.rid)
        if self.cached_features is not None:
            self.cached_features.release(state.rid)

    def _release(self, state: State) -> None:
        state.seq.free()
        self.history.release(state.rid)
        self._forget(state)
        if self.router is not None:
            self.router.release(state)

    # -- one step: drafts, execution, then the state changes ----------------------------------------

    def _execute(self, plan: StepPlan) -> StepResult | None:
        """Draft, size the prefill chunks with the budget left, and run the step (None: nothing to run)."""
        live, dev, r = plan.decode, self.target.device, self.router
        self._out.k = {state.rid: k for state, k in zip(live, plan.k)}
        drafts = proposals.drafts_for(self.drafter, set() if r is None else r.scored, self._ahead, self.history,
                                      live, plan.k, dev, None if r is None else r.costs,
                                      None if r is None else r.continuation)
        drafts = grammar.constrain(live, drafts, plan.k)   # deterministic drafts follow each request's grammar
        self._ahead = None
        plan.ahead = None if r is None or not self.drafter_caps.lookahead else r.asks_next(live, plan.k)
        self._apply_drafts(live, drafts)
        fed, decoding = len(live) + sum(drafts.counts), sum(blocks_for(s, 1 + c) for s, c in zip(live, drafts.counts))
        self._admit(self.scheduler.admit(self.pool.allocator.num_free - decoding))
        plan.prefill = self.scheduler.plan_prefill(plan.budget - fed, self.pool.allocator.num_free - decoding)
        if not live and not plan.prefill:
            return None
        sampled = any(state.req.temperature > 0 for state in live)
        offsets = Offsets([state.next_offset() for state in live] if live and sampled else None,
                          [state.next_offset() for state in plan.first])
        return execute(self.target, self.pool, self.history, self.drafter, plan, drafts, offsets, self.drafter_caps)

    def _admit(self, admitted: list[State]) -> None:
        """Start newly admitted requests on their cached blocks (prefix caching), and a feature
        drafter's on those blocks' cached feature rows (passed as if prefilled)."""
        if self.prefix_caching:
            cache = self.cached_features
            for state in admitted:
                names = state.block_names(self.pool.allocator.block_size)
                state.prefilled = state.seq.adopt(names if cache is None else names[:cache.leading(names)])
                if cache is not None:
                    state.features = cache.resume(state.rid, names[:len(state.seq.blocks)])

    def _finish_prefill(self, chunks: list[PrefillChunk]) -> None:
        """Commit the chunks' tokens to the KV; a request whose prompt is in starts decoding."""
        for chunk in chunks:
            s = chunk.state
            s.seq.commit(chunk.num_tokens)
            s.seq.cache_full_blocks(s.tokens)
            s.prefilled += chunk.num_tokens
        self.scheduler.prefilled([c.state for c in chunks if c.completes])

    def _apply_drafts(self, live: list[State], drafts: StepDrafts) -> None:
        for s, used in zip(live, drafts.offsets_used):
            s.offset += used
            if drafts.passed_features:
                s.features = []    # passed once

    def _postprocess(self, plan: StepPlan, result: StepResult | None) -> StepOutput:
        """Apply a step's result: KV lengths, hidden states, metrics, router, drafter, emission."""
        out = self._out
        if result is not None:
            first, resumed = plan.first, plan.resumed
            self._finish_prefill(plan.prefill)
            self._commit(plan.decode, result)
            self._keep_prefill_hidden(plan, result, first + resumed)
            for j, state in enumerate(first):
                if result.reads.first_dead is not None and result.reads.first_dead[j]:
                    self._fail(state)
                    continue
                token = int(result.reads.first[j])
                logprobs = None if state.req.logprobs is None else [
                    logprob_entry(result.reads.first_logprobs, j, token, state.req.logprobs, result.top_n)]
                self._emit(state, [token], logprobs)
            if result.lookahead is not None:
                ahead = result.lookahead
                ahead.valid = ahead.caps if result.reads.lookahead_valid is None else proposals.valid_counts(
                    result.reads.lookahead_valid, ahead.caps)
                self._ahead = ahead
            out.num_batched_tokens = result.fed + sum(c.num_tokens for c in plan.prefill)
        for state in self.scheduler.drop_finished():
            self._release(state)
            out.finished.append(state.rid)
        self.steps += 1
        return out

    def _keep_prefill_hidden(self, plan: StepPlan, result: StepResult, completed: list[State]) -> None:
        """A prefill chunk's features (a feature drafter), or a completed prefill's last hidden state."""
        at, done = result.fed, set(map(id, completed))
        for j, (s, n) in enumerate((chunk.state, chunk.num_tokens) for chunk in plan.prefill):
            at += n
            if result.features:
                s.features.append(result.hidden[at - n:at])
                if self.cached_features is not None:
                    self.cached_features.add(s.rid, s.prefilled - n, s.features[-1], s.seq.hashes)
            elif id(s) in done:
                s.last_hidden = result.hidden[result.fed + j]

    def _commit(self, live: list[State], result: StepResult) -> None:
        """Host bookkeeping of the verify result: KV lengths, metrics, router, drafter, emission."""
        if not live:
            return
        reads, counts = result.reads, result.drafts.counts
        width = len(reads.out) // len(live)
        out = [[int(t) for t in reads.out[i * width:(i + 1) * width]] for i in range(len(live))]
        accepted = [int(a) for a in reads.accepted]
        self.metrics.observe(counts, accepted, [state.rid for state in live],   # kinds label drafted rows only
                             proposals.row_kinds(self.drafter, result.drafts, len(live)) if any(counts) else None)
        if self.drafter is not None:
            rids = [state.rid for state in live]
            self.drafter.commit(rids, [len(state.tokens) + a for state, a in zip(live, accepted)])
        if self.router is not None and (any(counts) or result.drafts.shadow or result.drafts.asked is not None):
            shadow = result.drafts.shadow
            self.router.observe(live, counts, accepted)
            self.router.observe_scores([live[i] for i, _ in shadow], reads.shadow_scores or [])
            if result.drafts.asked is not None:   # did the drafter offer anything where it was asked?
                scored = {i for i, _ in shadow}
                self.router.observe_offers(live, result.drafts.asked,
                                           [1 if i in scored else c for i, c in enumerate(counts)])
        row, max_k = 0, width - 1
        for i, state in enumerate(live):
            state.seq.commit(accepted[i] + 1)
            path = range(row, row + accepted[i] + 1) if reads.nodes is None else \
                [row] + [row + 1 + int(n) for n in reads.nodes[i * max_k:i * max_k + accepted[i]]]
            if result.features:   # the rows that produced the accepted drafts and the bonus token
                state.features.append(result.hidden[row:row + accepted[i] + 1] if reads.nodes is None
                                      else result.hidden[list(path)])
                at = len(state.tokens) - 1
            else:
                state.last_hidden = result.hidden[path[-1]]
            logprobs = None
            if state.req.logprobs is not None:
                logprobs = [logprob_entry(reads.logprobs, row + j, out[i][j], state.req.logprobs, result.top_n)
                            for j in range(accepted[i] + 1)]
            row += counts[i] + 1
            keep = accepted[i] + 1 if reads.dead is None else \
                next((j for j, r in enumerate(path) if reads.dead[r]), accepted[i] + 1)
            self._emit(state, out[i][:keep], None if logprobs is None else logprobs[:keep])
            if keep <= accepted[i]:   # a row on its path had no token left: the tokens from there are not valid
                self._fail(state)
            state.seq.cache_full_blocks(state.tokens)
            if self.cached_features is not None:
                self.cached_features.add(state.rid, at, state.features[-1], state.seq.hashes)

    def _emit(self, state: State, new: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        n0 = len(state.generated)
        try:
            state.commit_tokens(new)
            took, why = grammar.advance(state, state.generated[n0:])
            if why is not None:   # this request's grammar refused a token: it alone fails, before emitting it
                del state.tokens[len(state.tokens) - (len(state.generated) - n0 - took):]
                del state.generated[n0 + took:]
                self._fail(state, why)
        finally:
            now = time.perf_counter() - self._t0
            if n0 == 0 and state.generated:
                self.metrics.first_token(state.rid, now - state.arrival)
            if state.done:
                self.metrics.finished(state.rid, now - state.arrival, len(state.generated))
            if state.generated[n0:]:
                self._out.tokens.setdefault(state.rid, []).extend(state.generated[n0:])
                if logprobs is not None:
                    self._out.logprobs.setdefault(state.rid, []).extend(logprobs[:len(state.generated) - n0])
            if self.on_tokens is not None:
                self.on_tokens(state.rid, state.generated[n0:])

    def _fail(self, state: State, why: str | None = None) -> None:
        """End a request whose own parameters left a row without any token to emit (or ``why``
        it failed, naming the parameter); the step's other requests go on."""
        if state.rid in self._out.errors or (state.done and why is None):
            return
        state.done = True
        if why is not None:
            self._out.errors[state.rid] = f"{why} (request {state.rid})"
        else:
            req = state.req
            names = [n for n, on in (("allowed_token_ids", req.allowed_token_ids is not None),
                                     ("bad_words", bool(req.bad_words)), ("structured", state.matcher is not None))
                     if on] or ["sampling parameters"]
            self._out.errors[state.rid] = (
                f"{names[0]}: expected a token that {' and '.join(names)} leave allowed, got none after "
                f"{len(state.generated)} generated tokens (request {state.rid})")

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache so far, and how many were found there."""
        return self.scheduler.prefix_queries, self.scheduler.prefix_hits
