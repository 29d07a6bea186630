"""The KV allocator and a backend's KV ops as a hypothesis state machine, against a plain
model: every sequence is a list of committed token tags.

Rules: new sequence, reserve + write + commit (copy-on-write copies through ``copy_kv``,
writes through ``write_kv``), truncate, fork, free, double free, use after free, bad
arguments, and exhaustion (also during copy-on-write). After every step: refcounts equal
the number of holders, the free list is exactly the unreferenced blocks, every committed
token reads back exactly as written, and a step that raised changed nothing."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import hal
from hal.conformance._helpers import host, put
from hal.kv import block_copy_slots

pytestmark = pytest.mark.hal_op("write_kv", "copy_kv")
H, D = 1, 16


def machine(be, kv=hal.kv):
    """The state machine over ``be``'s KV ops and the allocator of module ``kv`` (a planted
    mutant of `hal.kv` in tests)."""
    bs = next(b for b in (4, 8, 16, 32, 64, 128) if b in be.spec.block_sizes)
    num_blocks = 6

    class KV(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.alloc = kv.BlockAllocator(num_blocks, bs)
            self.k, self.v = put(be, torch.zeros(num_blocks, bs, H, D), torch.zeros(num_blocks, bs, H, D))
            self.seqs: list = []
            self.model: list[list[float]] = []
            self.dead: list = []
            self.tag = 0.0

        def snapshot(self):
            return (list(self.alloc.refcount), list(self.alloc._free),
                    [(list(s.blocks), s.length, s.reserved, s.freed) for s in self.seqs + self.dead])

        @rule()
        def new(self):
            self.seqs.append(kv.Sequence(self.alloc))
            self.model.append([])

        @precondition(lambda self: self.seqs)
        @rule(i=st.integers(0, 99), n=st.integers(0, 3 * bs), keep=st.floats(0, 1))
        def step(self, i, n, keep):
            i %= len(self.seqs)
            s, before = self.seqs[i], self.snapshot()
            try:
                slots, copies = s.reserve(n)
            except hal.HalError:
                assert self.snapshot() == before, "a failed reserve changed the allocator"
                return
            if copies:
                be.copy_kv(self.k, self.v, *put(be, *block_copy_slots(copies, bs)))
            tags = [self.tag + j + 1 for j in range(n)]
            self.tag += n
            key = torch.tensor(tags).view(n, 1, 1).expand(n, H, D).contiguous()
            be.write_kv(*put(be, key, -key), self.k, self.v, put(be, torch.tensor(slots, dtype=torch.long)))
            m = int(keep * n)
            s.commit(m)
            self.model[i] += tags[:m]

        @precondition(lambda self: self.seqs)
        @rule(i=st.integers(0, 99), cut=st.floats(0, 1))
        def truncate(self, i, cut):
            i %= len(self.seqs)
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
        @rule(i=st.integers(0, 99))
        def free(self, i):
            i %= len(self.seqs)
            s = self.seqs.pop(i)
            self.model.pop(i)
            s.free()
            self.dead.append(s)

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
            holders = [0] * num_blocks
            for s in self.seqs:
                for b in s.blocks:
                    holders[b] += 1
            assert holders == self.alloc.refcount, "refcounts differ from the number of holders"
            free = self.alloc._free
            assert len(set(free)) == len(free), "a block is twice on the free list"
            assert sorted(free) == [b for b in range(num_blocks) if holders[b] == 0]

        @invariant()
        def committed_tokens_read_back(self):
            kh, vh = host(self.k).view(-1, H, D), host(self.v).view(-1, H, D)
            for s, tags in zip(self.seqs, self.model):
                assert s.length == len(tags)
                if tags:
                    slots = torch.tensor([s.slot(p) for p in range(s.length)])
                    assert kh[slots, 0, 0].tolist() == tags, "a committed key reads back wrong"
                    assert (-vh[slots, 0, 0]).tolist() == tags, "a committed value reads back wrong"

    return KV


def run(be, kv=hal.kv, n: int | None = None) -> None:
    n = n or int(os.environ.get("HAL_KV_EXAMPLES", "25"))
    run_state_machine_as_test(machine(be, kv), settings=settings(
        max_examples=n, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck)))


def test_kv_state_machine(backend):
    run(backend)
