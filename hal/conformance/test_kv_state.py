"""The KV allocator and a backend's KV ops as a hypothesis state machine, against a plain
model: every sequence is a list of committed token tags.

Rules: new sequence, reserve + write + commit (copy-on-write copies through ``copy_kv``,
writes through ``write_kv``), truncate, fork, free, double free, use after free, bad
arguments, exhaustion (also during copy-on-write), and the prefix cache: offering full
blocks, a new sequence adopting the cached prefix of a live or a freed sequence's tokens
(sharing, reuse after free), and evictions whenever a new block is needed. After every
step: refcounts equal the number of holders, the free and idle-cached lists are exactly
the unreferenced blocks (so nothing held is ever reused), every cached name points at a
block holding those tokens, every committed token reads back exactly as written, and a
step that raised changed nothing."""

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import hal
from hal.conformance._helpers import host, put
from hal.kv import block_copy_slots

pytestmark = pytest.mark.hal_op("write_kv", "copy_kv")
H, D = 1, 16


class KVMachine(RuleBasedStateMachine):
    """The machine; `machine` binds it to a backend (``be``), an allocator module (``kv``) and
    the backend's smallest block size (``bs``)."""

    be, kv, bs, num_blocks = None, hal.kv, 0, 6

    def __init__(self):
        super().__init__()
        self.alloc = self.kv.BlockAllocator(self.num_blocks, self.bs, caching=True)
        shape = (self.num_blocks, self.bs, H, D)
        self.k, self.v = put(self.be, torch.zeros(shape), torch.zeros(shape))
        self.seqs: list = []
        self.model: list[list[float]] = []
        self.dead: list = []
        self.tag = 0.0
        self.past: list[list[float]] = []   # token tags of freed sequences (their blocks may still be cached)
        self.offered: list[list[float]] = []   # every token list offered to the cache (checked for ever)

    def snapshot(self):
        return (list(self.alloc.refcount), list(self.alloc._free), list(self.alloc._idle),
                dict(self.alloc._by_hash),
                [(list(s.blocks), s.length, s.reserved, s.freed) for s in self.seqs + self.dead])

    @rule()
    def new(self):
        self.seqs.append(self.kv.Sequence(self.alloc))
        self.model.append([])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), n=st.integers(0, 3 * 128), keep=st.just(1.0) | st.floats(0, 1), offer=st.booleans())
    def step(self, i, n, keep, offer):
        i %= len(self.seqs)
        n %= 3 * self.bs + 1   # 0 .. 3 blocks' worth
        s, before = self.seqs[i], self.snapshot()
        try:
            slots, copies = s.reserve(n)
        except hal.HalError:
            assert self.snapshot() == before, "a failed reserve changed the allocator"
            return
        if copies:
            self.be.copy_kv(self.k, self.v, *put(self.be, *block_copy_slots(copies, self.bs)))
        tags = [self.tag + j + 1 for j in range(n)]
        self.tag += n
        key = torch.tensor(tags).view(n, 1, 1).expand(n, H, D).contiguous()
        self.be.write_kv(*put(self.be, key, -key), self.k, self.v,
                         put(self.be, torch.tensor(slots, dtype=torch.long)))
        m = int(keep * n)
        s.commit(m)
        self.model[i] += tags[:m]
        if offer:   # as the engine does after each commit
            self._offer(i)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), cut=st.floats(0, 1), offer=st.booleans())
    def truncate(self, i, cut, offer):
        i %= len(self.seqs)
        if offer:   # named blocks past the cut must lose their names before they are rewritten
            self._offer(i)
        n = int(cut * self.seqs[i].length)
        self.seqs[i].truncate(n)
        del self.model[i][n:]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        i %= len(self.seqs)
        self.seqs.append(self.seqs[i].fork())
        self.model.append(list(self.model[i]))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), offer=st.booleans())
    def free(self, i, offer):
        i %= len(self.seqs)
        if offer:   # its full blocks stay cached after it is gone
            self._offer(i)
        s = self.seqs.pop(i)
        self.past.append(self.model.pop(i))
        s.free()
        self.dead.append(s)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def offer(self, i):
        self._offer(i % len(self.seqs))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def recycle(self, i):
        """Free a sequence, then adopt its tokens anew (its cached blocks come back from idle)."""
        i = max(range(len(self.seqs)), key=lambda j: (len(self.model[j]), -j)) if i == 0 else i % len(self.seqs)
        if len(self.model[i]) < self.bs:   # give it a full block first (when the pool has room)
            self.step(i, self.bs, 1.0, False)
        self._offer(i)
        tokens = self.model[i]
        self.free(i, False)
        s = self.kv.Sequence(self.alloc)
        got = s.adopt(self.kv.block_hashes([int(t) for t in tokens], self.bs))
        assert got == len(tokens) // self.bs * self.bs, "a freed sequence's cached blocks were not found again"
        self.seqs.append(s)
        self.model.append(list(tokens[:got]))

    def _offer(self, i):
        self.seqs[i].cache_full_blocks([int(t) for t in self.model[i]])
        self.offered.append(list(self.model[i]))

    @precondition(lambda self: self.seqs or self.past or self.offered)
    @rule(i=st.integers(0, 99))
    def adopt(self, i):
        pick = sorted(self.model + self.past + self.offered, key=len, reverse=True)   # i = 0: the longest
        tokens = pick[i % len(pick)]
        s = self.kv.Sequence(self.alloc)
        got = s.adopt(self.kv.block_hashes([int(t) for t in tokens], self.bs))
        assert got % self.bs == 0 and got <= len(tokens)
        self.seqs.append(s)
        self.model.append(list(tokens[:got]))

    @precondition(lambda self: self.dead)
    @rule(i=st.integers(0, 99), what=st.sampled_from(["free", "reserve", "fork", "commit", "truncate"]))
    def use_after_free(self, i, what):
        s, before = self.dead[i % len(self.dead)], self.snapshot()
        with pytest.raises(hal.HalError):
            {"free": s.free, "reserve": lambda: s.reserve(1), "fork": s.fork, "commit": lambda: s.commit(0),
             "truncate": lambda: s.truncate(0)}[what]()
        assert self.snapshot() == before, "a refused call changed the allocator"

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), bad=st.sampled_from([-1, 1.5, True, "2", None, 2 ** 70]))
    def bad_arguments(self, i, bad):
        s, before = self.seqs[i % len(self.seqs)], self.snapshot()
        for call in (lambda: s.reserve(bad), lambda: s.commit(bad), lambda: s.truncate(bad)):
            with pytest.raises(hal.HalError):   # a bool is no count; 2**70 blocks do not exist
                call()
            assert self.snapshot() == before, "a refused call changed the allocator"

    @invariant()
    def refcounts_and_free_list(self):
        holders = [0] * self.num_blocks
        for s in self.seqs:
            for b in s.blocks:
                holders[b] += 1
        assert holders == self.alloc.refcount, "refcounts differ from the number of holders"
        free, idle = self.alloc._free, list(self.alloc._idle)
        assert len(set(free + idle)) == len(free + idle), "a block is twice on the free lists"
        assert sorted(free + idle) == [b for b in range(self.num_blocks) if holders[b] == 0], \
            "the free lists are not exactly the unheld blocks (a held block could be reused)"
        assert all(self.alloc.cached(b) for b in idle) and not any(self.alloc.cached(b) for b in free)

    @invariant()
    def cached_names_hold_their_tokens(self):
        kh = host(self.k).view(-1, H, D)
        for tokens in self.model + self.past + self.offered:
            names = self.kv.block_hashes([int(t) for t in tokens], self.bs)
            for bi, b in enumerate(self.alloc.match(names)):
                got = kh[b * self.bs:(b + 1) * self.bs, 0, 0].tolist()
                assert got == tokens[bi * self.bs:(bi + 1) * self.bs], "a cached block does not hold its tokens"

    @invariant()
    def committed_tokens_read_back(self):
        kh, vh = host(self.k).view(-1, H, D), host(self.v).view(-1, H, D)
        for s, tags in zip(self.seqs, self.model):
            assert s.length == len(tags)
            if tags:
                slots = torch.tensor([s.slot(p) for p in range(s.length)])
                assert kh[slots, 0, 0].tolist() == tags, "a committed key reads back wrong"
                assert (-vh[slots, 0, 0]).tolist() == tags, "a committed value reads back wrong"


def machine(be, kv=hal.kv):
    """The state machine over ``be``'s KV ops and the allocator of module ``kv`` (a planted
    mutant of `hal.kv` in tests)."""
    bs = next(b for b in (2, 4, 8, 16, 32, 64, 128) if b in be.spec.block_sizes)
    return type("KV", (KVMachine,), {"be": be, "kv": kv, "bs": bs})


def run(be, kv=hal.kv, n: int | None = None, shrink: bool = True) -> None:
    """The state machine on ``be`` (``kv``: the allocator module). ``shrink=False`` reports the
    first failing sequence as found (a planted mutant only has to fail, not to be minimal)."""
    n = n or int(os.environ.get("HAL_KV_EXAMPLES", "25"))
    phases = tuple(p for p in Phase if shrink or p is not Phase.shrink)
    run_state_machine_as_test(machine(be, kv), settings=settings(
        max_examples=n, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        report_multiple_bugs=False, phases=phases,
        suppress_health_check=list(HealthCheck)))


def test_kv_state_machine(backend):
    run(backend)
