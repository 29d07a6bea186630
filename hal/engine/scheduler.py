"""Scheduling, apart from execution (vLLM v1's ``core/sched``): the queues of requests in
flight and the policy that decides, each step, who decodes with how many drafts, who is
preempted when KV blocks run out, and which prompts prefill in what chunks.

Under ``max_num_batched_tokens`` (prefill tokens + each running request's last token +
every draft token): running requests decode first; the budget left prefills waiting
requests, in chunks. When KV blocks run out, drafts go first, then the latest-arrived
running request is preempted (the engine frees its blocks; it is recomputed later from
its tokens). Prefill chunks are sized once the drafts are known (`Scheduler.plan_prefill`),
so a short proposal leaves its budget to prefill. With prefix caching, an admitted request
starts on the cached blocks of its tokens (`hal.engine.prefix`).

The scheduler owns its queues and returns decisions; the engine alone changes request
state (starts a request on its cached blocks, commits prefill tokens, preempts)."""

from __future__ import annotations

from collections import deque
from typing import Callable

from hal import kv
from hal.engine import prefix
from hal.engine.requests import State
from hal.engine.step_types import PrefillChunk, StepPlan

ChooseK = Callable[[list[State], int], list[int]]   # (running requests, token budget) -> drafts allowed each


def blocks_for(state: State, num_tokens: int) -> int:
    """New KV blocks ``state`` needs to hold ``num_tokens`` more tokens."""
    seq = state.seq
    return max(0, -(-(seq.length + num_tokens) // seq.block_size) - len(seq.blocks))


class Scheduler:
    """The request queues and the step policy. ``preempt`` is the engine's: it frees a
    request's blocks, resets it and hands it back through `requeue`. ``usable``: how many
    leading cached blocks a request may start on (`hal.engine.prefix.Usable`; None: all)."""

    def __init__(self, allocator: kv.BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int | None,
                 preempt: Callable[[State], None], usable: prefix.Usable | None = None):
        self.allocator, self.max_num_seqs, self.usable = allocator, max_num_seqs, usable
        self.max_num_batched_tokens, self._preempt = max_num_batched_tokens, preempt
        self.waiting: deque[State] = deque()    # new and preempted requests, in priority order
        self.prefilling: list[State] = []       # admitted, prompt partly in the KV
        self.running: list[State] = []          # decoding, in priority (arrival) order
        self.prefix_queries = self.prefix_hits = 0   # prompt tokens looked up in the prefix cache, and found

    def add(self, state: State) -> None:
        self.waiting.append(state)

    def remove(self, state: State) -> bool:
        """Take ``state`` out of whichever queue holds it; False if none does."""
        for queue in (self.waiting, self.prefilling, self.running):
            if state in queue:
                queue.remove(state)
                return True
        return False

    def find(self, rid: int) -> State | None:
        return next((s for q in (self.waiting, self.prefilling, self.running) for s in q if s.rid == rid), None)

    def requeue(self, state: State) -> None:
        """A preempted request goes back to the waiting queue, in priority (arrival) order."""
        at = next((j for j, w in enumerate(self.waiting) if w.rid > state.rid), len(self.waiting))
        self.waiting.insert(at, state)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # -- the decode half of a step ---------------------------------------------------------------

    def schedule(self, choose_k: ChooseK) -> StepPlan:
        """Who decodes this step and with how many drafts: k as ``choose_k`` wants it, shrunk
        to the token budget, then to the free KV blocks; while even k = 0 does not fit, the
        latest-arrived request in flight is preempted (the earliest always fits alone, so
        this ends)."""
        budget = self.max_num_batched_tokens or 1 << 62
        decode = list(self.running)
        ks = list(choose_k(decode, budget)) if decode else []
        while sum(1 + k for k in ks) > budget and any(ks):
            ks[max(range(len(ks)), key=ks.__getitem__)] -= 1
        while decode and sum(blocks_for(s, 1 + k) for s, k in zip(decode, ks)) > self.allocator.num_free:
            if any(ks):
                ks = [0] * len(ks)
                continue
            victim = max(decode + self.prefilling, key=lambda s: s.rid)
            if victim in decode:
                del ks[decode.index(victim)]
                decode.remove(victim)
            self._preempt(victim)
        return StepPlan(decode, ks, budget)

    # -- the prefill half ------------------------------------------------------------------------

    def admit(self, free: int) -> list[State]:
        """Waiting requests that join the prefill now, within ``free`` blocks: each can finish
        its (re)prefill plus one token in blocks nobody has claimed yet. The engine starts
        each on its cached blocks (`hal.engine.prefix`) before `plan_prefill`."""
        claimed = sum(blocks_for(state, state.prefill_end() - state.prefilled + 1) for state in self.prefilling)
        caching, at, admitted, taken = self.allocator.caching, 0, [], set()
        in_flight = prefix.pending(self.prefilling) if caching else set()
        while at < len(self.waiting) and len(self.running) + len(self.prefilling) < self.max_num_seqs:
            state = self.waiting[at]
            hit, wait = prefix.lookup(state, self.allocator, in_flight, self.usable) if caching else ([], False)
            if wait:      # a request in prefill is computing its next block: take it from the cache next step
                at += 1
                continue
            revived = {b for b in hit if self.allocator.refcount[b] == 0} - taken
            need = -(-(state.prefill_end() + 1) // self.allocator.block_size) - len(hit)
            if need + len(revived) > free - claimed:
                break
            claimed, free, taken = claimed + need, free - len(revived), taken | revived
            del self.waiting[at]
            if caching:
                self.prefix_queries += state.prefill_end()
                self.prefix_hits += len(hit) * self.allocator.block_size
                in_flight.update(state.block_names(self.allocator.block_size)[len(hit):])
            self.prefilling.append(state)
            admitted.append(state)
        return admitted

    def plan_prefill(self, budget: int, free: int) -> list[PrefillChunk]:
        """The prefill chunks of this step, in admission order, within ``budget`` tokens and
        ``free`` blocks."""
        chunks, block_size = [], self.allocator.block_size
        for state in self.prefilling:
            room = (len(state.seq.blocks) + free) * block_size - state.seq.length
            n = min(state.prefill_end() - state.prefilled, budget, room)
            if n <= 0:
                break
            free -= blocks_for(state, n)
            budget -= n
            chunks.append(PrefillChunk(state, n, state.prefilled + n == state.prefill_end()))
        return chunks

    def prefilled(self, states: list[State]) -> None:
        """``states``' prompts are in the KV: they decode from the next step."""
        for s in states:
            self.prefilling.remove(s)
            self.running.append(s)
        self.running.sort(key=lambda x: x.rid)

    def drop_finished(self) -> list[State]:
        """Take finished requests off the running queue; returns them."""
        done = [s for s in self.running if s.done]
        for s in done:
            self.running.remove(s)
        return done
