"""KV ops: write_kv + paged_attention against dense attention, rollback, fork, tree
compaction with copy_kv, padding slots. fp32 compares at atol 1e-4, fp16/bf16 at 2e-2
(the reference runs in float64)."""

import pytest
import torch

from hal.conformance._helpers import host, put
from hal.kv import BlockAllocator, Sequence, block_copy_slots, block_tables

Hq, Hkv, D = 4, 2, 16
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def block_size_or_skip(be, bs):
    if bs not in be.spec.block_sizes:
        pytest.skip(f"block size {bs} not supported by {be.name} ({be.spec.block_sizes})")
    return bs


def dense(q, k, v, scale, allowed):
    """q [Q, Hq, D], k/v [S, Hkv, D], allowed [Q, S] -> [Q, Hq, D] in float64."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,shd->hqs", q.double(), k) * scale
    s = s.masked_fill(~allowed[None], -torch.inf)
    return torch.einsum("hqs,shd->qhd", s.softmax(-1), v)


def causal(q_len, S):
    return torch.arange(S)[None] <= (S - q_len + torch.arange(q_len))[:, None]


class Cache:
    """A paged cache on the backend plus the dense truth the test keeps on the host."""

    def __init__(self, be, bs, num_blocks, dtype, seed):
        self.be, self.bs, self.dtype = be, bs, dtype
        self.g = torch.Generator().manual_seed(seed)
        sentinel = torch.randn(num_blocks, bs, Hkv, D, generator=self.g).to(dtype)
        self.k, self.v = put(be, sentinel.clone(), (sentinel * 2).clone())
        self.alloc = BlockAllocator(num_blocks, bs)
        self.alloc._free = torch.randperm(num_blocks, generator=self.g).tolist()  # scattered blocks

    def rand(self, n):
        return (torch.randn(n, Hkv, D, generator=self.g).to(self.dtype),
                torch.randn(n, Hkv, D, generator=self.g).to(self.dtype))

    def write(self, slots, k, v):
        self.be.write_kv(*put(self.be, k, v), self.k, self.v, put(self.be, torch.tensor(slots, dtype=torch.long)))

    def attend(self, seqs, q, q_lens, tree_mask=None):
        qsl = torch.tensor([0] + q_lens).cumsum(0)
        seq_lens = torch.tensor([s.length for s in seqs])
        bt = block_tables(seqs)
        out = self.be.paged_attention(*put(self.be, q, self.k, self.v, bt, seq_lens, qsl), D ** -0.5,
                                      put(self.be, tree_mask))
        return host(out)


@pytest.mark.hal_op("write_kv", "paged_attention")
@pytest.mark.parametrize("bs", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_matches_dense(backend, bs, dtype):
    block_size_or_skip(backend, bs)
    c = Cache(backend, bs, 24, dtype, seed=bs)
    lens = [(37, 1), (50, 4), (21, 21), (5, 1), (130, 6)]   # (seq_len, q_len): decode, verify, prefill
    seqs, truth = [], []
    for S, _ in lens:
        s = Sequence(c.alloc)
        slots, _ = s.reserve(S)
        k, v = c.rand(S)
        # one write with padding slots mixed in
        c.write(slots[:3] + [-1, -1] + slots[3:], torch.cat([k[:3], k[:2], k[3:]]), torch.cat([v[:3], v[:2], v[3:]]))
        s.commit(S)
        seqs.append(s)
        truth.append((k, v))
    q_lens = [ql for _, ql in lens]
    q = torch.randn(sum(q_lens), Hq, D, generator=c.g).to(dtype)
    out = c.attend(seqs, q, q_lens)
    assert out.dtype == dtype and out.shape == q.shape
    start = 0
    for (S, ql), (k, v) in zip(lens, truth):
        want = dense(q[start:start + ql], k, v, D ** -0.5, causal(ql, S))
        torch.testing.assert_close(out[start:start + ql].double(), want, atol=TOL[dtype], rtol=0)
        start += ql


@pytest.mark.hal_op("paged_attention")
def test_tree_mask(backend):
    bs = next(b for b in (16, 32, 64, 128) if b in backend.spec.block_sizes)
    c = Cache(backend, bs, 8, torch.float32, seed=5)
    parents = [-1, -1, 0, 0, 1, 2]          # 6 tree nodes after a 20-token context
    n, ctx = len(parents), 20
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    s = Sequence(c.alloc)
    slots, _ = s.reserve(ctx + n)
    k, v = c.rand(ctx + n)
    c.write(slots, k, v)
    s.commit(ctx + n)
    q = torch.randn(n, Hq, D, generator=c.g)
    mask = torch.zeros(n, 8, dtype=torch.bool)
    mask[:, :n] = anc
    out = c.attend([s], q, [n], tree_mask=mask)
    allowed = torch.cat([torch.ones(n, ctx, dtype=torch.bool), anc], 1)
    torch.testing.assert_close(out.double(), dense(q, k, v, D ** -0.5, allowed), atol=1e-4, rtol=0)


@pytest.mark.hal_op("write_kv", "paged_attention", "copy_kv")
def test_append_verify_rollback_append_and_fork(backend):
    bs = next(b for b in (16, 32, 64, 128) if b in backend.spec.block_sizes)
    c = Cache(backend, bs, 8, torch.float32, seed=6)
    s = Sequence(c.alloc)
    P = bs - 3                                   # the verify step crosses a block boundary
    slots, _ = s.reserve(P)
    kp, vp = c.rand(P)
    c.write(slots, kp, vp)
    s.commit(P)
    slots, _ = s.reserve(5)                      # verify 5 tokens, keep 2 (1 accepted + 1 bonus)
    ks, vs = c.rand(5)
    c.write(slots, ks, vs)
    s.commit(2)
    slots, _ = s.reserve(3)                      # next step overwrites the rejected slots
    kn, vn = c.rand(3)
    c.write(slots, kn, vn)
    s.commit(3)
    K, V = torch.cat([kp, ks[:2], kn]), torch.cat([vp, vs[:2], vn])
    q = torch.randn(1, Hq, D, generator=c.g)
    torch.testing.assert_close(c.attend([s], q, [1]).double(), dense(q, K, V, D ** -0.5, causal(1, len(K))),
                               atol=1e-4, rtol=0)
    # copy-on-write fork: the child's next token must not leak into the parent
    child = s.fork()
    slots, copies = child.reserve(1)
    assert copies, "the shared partial block must be copied before the child writes"
    src, dst = block_copy_slots(copies, bs)
    backend.copy_kv(c.k, c.v, *put(backend, src, dst))
    kc, vc = c.rand(1)
    c.write(slots, kc, vc)
    child.commit(1)
    both = c.attend([s, child], torch.cat([q, q]), [1, 1])
    torch.testing.assert_close(both[:1].double(), dense(q, K, V, D ** -0.5, causal(1, len(K))), atol=1e-4, rtol=0)
    K2, V2 = torch.cat([K, kc]), torch.cat([V, vc])
    torch.testing.assert_close(both[1:].double(), dense(q, K2, V2, D ** -0.5, causal(1, len(K2))),
                               atol=1e-4, rtol=0)


@pytest.mark.hal_op("copy_kv")
@pytest.mark.parametrize("path", [[1, 3], [0, 2, 4], [4]])
def test_tree_compaction(backend, path):
    bs = next(b for b in (16, 32, 64, 128) if b in backend.spec.block_sizes)
    c = Cache(backend, bs, 8, torch.float32, seed=7)
    ctx, n = bs - 2, 5                        # the tree spans a block boundary
    s = Sequence(c.alloc)
    slots, _ = s.reserve(ctx + n)
    k, v = c.rand(ctx + n)
    c.write(slots, k, v)
    src = torch.tensor([slots[ctx + i] for i in path])
    dst = torch.tensor([slots[ctx + d] for d in range(len(path))])
    backend.copy_kv(c.k, c.v, *put(backend, src, dst))
    s.commit(ctx + len(path))
    keep = list(range(ctx)) + [ctx + i for i in path]
    q = torch.randn(1, Hq, D, generator=c.g)
    want = dense(q, k[keep], v[keep], D ** -0.5, causal(1, len(keep)))
    torch.testing.assert_close(c.attend([s], q, [1]).double(), want, atol=1e-4, rtol=0)


@pytest.mark.hal_op("write_kv")
def test_padding_slots_leave_cache_untouched(backend):
    bs = next(b for b in (16, 32, 64, 128) if b in backend.spec.block_sizes)
    c = Cache(backend, bs, 4, torch.float32, seed=8)
    before_k, before_v = host(c.k).clone(), host(c.v).clone()
    k, v = c.rand(6)
    slots = [-1, 5, -1, bs * 4 - 1, -1, 0]
    c.write(slots, k, v)
    want_k, want_v = before_k.view(-1, Hkv, D).clone(), before_v.view(-1, Hkv, D).clone()
    for t, sl in enumerate(slots):
        if sl >= 0:
            want_k[sl], want_v[sl] = k[t], v[t]
    assert torch.equal(host(c.k).view(-1, Hkv, D), want_k)
    assert torch.equal(host(c.v).view(-1, Hkv, D), want_v)


@pytest.mark.hal_op("copy_kv")
def test_copy_reads_all_sources_first(backend):
    """A rotation of slots (each destination is another copy's source)."""
    bs = next(b for b in (16, 32, 64, 128) if b in backend.spec.block_sizes)
    c = Cache(backend, bs, 2, torch.float32, seed=9)
    before_k, before_v = host(c.k).clone().view(-1, Hkv, D), host(c.v).clone().view(-1, Hkv, D)
    src, dst = torch.tensor([1, 2, 3, bs + 1]), torch.tensor([2, 3, bs + 1, 1])
    backend.copy_kv(c.k, c.v, *put(backend, src, dst))
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[dst], want_v[dst] = before_k[src], before_v[src]
    assert torch.equal(host(c.k).view(-1, Hkv, D), want_k) and torch.equal(host(c.v).view(-1, Hkv, D), want_v)
