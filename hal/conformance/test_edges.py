"""Edge inputs the outside fuzz of the op contract found (issue "Hardening"), one named test
each: empty batches, size bounds, strides, unused block-table entries, tiny temperatures,
extreme logits, head-padded caches, probabilities slightly above 1, aliased caches."""

import math

import pytest
import torch

import hal
from hal.checks import MAX_K, MAX_NGRAM
from hal.conformance._helpers import bs_of, host, put

I64 = torch.int64


def empty_so(be, R=0):
    return put(be, torch.zeros(R, dtype=I64), torch.zeros(R, dtype=I64))


# -- item 6: empty batches are valid and give empty outputs ------------------------------------

@pytest.mark.hal_op("sample", "verify_rejection", "verify_typical", "verify_tree", "verify_greedy")
def test_empty_batch_verify_and_sample(backend):
    be, V = backend, 8
    ids, cu = put(be, torch.zeros(0, dtype=I64), torch.zeros(1, dtype=I64))
    tok, q = be.sample(*put(be, torch.zeros(0, V), torch.ones(0), torch.zeros(0, dtype=torch.int32), torch.ones(0)),
                       *empty_so(be))
    assert tok.shape == (0,) and q.shape == (0, V)
    for out in (be.verify_rejection(ids, cu, None, put(be, torch.zeros(0, V)), *empty_so(be), 2),
                be.verify_typical(ids, cu, put(be, torch.zeros(0, V)), *empty_so(be), 2),
                be.verify_greedy(ids, cu, put(be, torch.zeros(0, V)), 2),
                be.verify_tree(ids, cu, ids, put(be, torch.zeros(0, V)), None, *empty_so(be), 2),
                be.verify_tree(ids, cu, ids, put(be, torch.zeros(0, V)), None, None, None, 2)):
        assert out[0].shape == (0, 3) and out[-1].shape == (0,)


@pytest.mark.hal_op("ngram_propose")
def test_empty_history_proposes_nothing(backend):
    drafts, num = backend.ngram_propose(*put(backend, torch.zeros(2, 0, dtype=I64), torch.zeros(2, dtype=I64)), 1, 3, 4)
    assert host(drafts).tolist() == [[-1] * 4] * 2 and host(num).tolist() == [0, 0]


@pytest.mark.hal_op("write_kv", "copy_kv", "paged_attention")
def test_empty_kv_ops(backend):
    bs = bs_of(backend)
    kc, vc = put(backend, torch.randn(2, bs, 2, 16), torch.randn(2, bs, 2, 16))
    before = host(kc).clone()
    e = put(backend, torch.zeros(0, dtype=I64))
    backend.write_kv(*put(backend, torch.zeros(0, 2, 16), torch.zeros(0, 2, 16)), kc, vc, e)
    backend.copy_kv(kc, vc, e, e)
    out = backend.paged_attention(put(backend, torch.zeros(0, 4, 16)), kc, vc,
                                  put(backend, torch.zeros(0, 1, dtype=torch.int32)), e,
                                  put(backend, torch.zeros(1, dtype=I64)), 0.25)
    assert out.shape == (0, 4, 16) and torch.equal(host(kc), before)


# -- item 5: size arguments are bounded ----------------------------------------------------------

@pytest.mark.hal_op("verify_greedy", "ngram_propose")
@pytest.mark.parametrize("op,name,value", [("verify_greedy", "max_k", 2 ** 40), ("verify_greedy", "max_k", MAX_K + 1),
                                           ("ngram_propose", "k", 2 ** 62), ("ngram_propose", "max_n", 2 ** 40),
                                           ("ngram_propose", "min_n", MAX_NGRAM + 1)])
def test_huge_sizes_are_refused(backend, op, name, value):
    be = backend
    if op == "verify_greedy":
        args = put(be, torch.tensor([1]), torch.tensor([0, 1]), torch.zeros(2, 8))
        call = lambda: be.verify_greedy(*args, value)  # noqa: E731
    else:
        kw = dict(min_n=1, max_n=2, k=2)
        kw[name] = value
        if name == "min_n":
            kw["max_n"] = value
        call = lambda: be.ngram_propose(*put(be, torch.tensor([[1, 2, 1, 2]]), torch.tensor([4])), **kw)  # noqa: E731
    with pytest.raises(hal.HalError) as e:
        call()
    assert e.value.arg == name


@pytest.mark.hal_op("ngram_propose")
def test_max_n_longer_than_the_history(backend):
    """A max_n above the history length is valid (and cheap): no suffix is longer than the history."""
    drafts, num = backend.ngram_propose(*put(backend, torch.tensor([[1, 2, 3, 1, 2]]), torch.tensor([5])), 1,
                                        MAX_NGRAM, 3)
    assert host(drafts).tolist() == [[3, 1, 2]] and host(num).tolist() == [3]


# -- item 2: any strides ---------------------------------------------------------------------

@pytest.mark.hal_op("write_kv")
def test_strided_slot_mapping_writes_only_its_slots(backend):
    bs = bs_of(backend)
    kc, vc = put(backend, torch.zeros(4, bs, 2, 16), torch.zeros(4, bs, 2, 16))
    slots = put(backend, torch.tensor([3, bs + 4, 5, bs + 5]))[::2]     # [3, 5], not contiguous
    backend.write_kv(*put(backend, torch.ones(2, 2, 16), torch.ones(2, 2, 16)), kc, vc, slots)
    written = (host(kc).view(-1, 2, 16).abs().sum((1, 2)) > 0).nonzero().flatten().tolist()
    assert written == [3, 5]


@pytest.mark.hal_op("verify_greedy", "verify_rejection")
def test_strided_ragged_arguments(backend):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 8, generator=g)
    ids, cu = torch.tensor([1, 9, 2, 9, 3, 9]), torch.tensor([0, 9, 1, 9, 3, 9])
    dense = backend.verify_greedy(*put(backend, ids[::2].clone(), cu[::2].clone(), logits), 2)
    strided = backend.verify_greedy(put(backend, ids)[::2], put(backend, cu)[::2], put(backend, logits), 2)
    assert all(torch.equal(host(a), host(b)) for a, b in zip(dense, strided))
    p = torch.softmax(logits, -1)
    seeds, offs = torch.tensor([5, 0, 6, 0]), torch.tensor([1, 0, 2, 0])
    a = backend.verify_rejection(*put(backend, ids[::2].clone(), cu[::2].clone()), None,
                                 *put(backend, p, seeds[::2].clone(), offs[::2].clone()), 2)
    b = backend.verify_rejection(put(backend, ids)[::2], put(backend, cu)[::2], None, put(backend, p.t().contiguous().t()),
                                 put(backend, seeds)[::2], put(backend, offs)[::2], 2)
    assert all(torch.equal(host(x), host(y)) for x, y in zip(a, b))


# -- items 7 and 9: paged attention reads only used block-table entries; head-padded caches ----

@pytest.mark.hal_op("paged_attention")
def test_unused_block_table_entries_are_never_read(backend):
    bs = bs_of(backend)
    kc, vc = put(backend, torch.randn(4, bs, 2, 16), torch.randn(4, bs, 2, 16))
    q = put(backend, torch.randn(1, 4, 16))
    args = (put(backend, torch.tensor([3])), put(backend, torch.tensor([0, 1])), 0.25)
    garbage = backend.paged_attention(q, kc, vc, put(backend, torch.tensor([[2, 10 ** 6]], dtype=torch.int32)), *args)
    clean = backend.paged_attention(q, kc, vc, put(backend, torch.tensor([[2, 0]], dtype=torch.int32)), *args)
    assert torch.equal(host(garbage), host(clean))


@pytest.mark.hal_op("paged_attention", "write_kv", "copy_kv")
def test_head_padded_cache(backend):
    """Caches padded along head_dim (a view [..., :D] of a wider allocation) work in place."""
    bs, D = bs_of(backend), 16
    wide_k, wide_v = put(backend, torch.randn(4, bs, 2, 2 * D), torch.randn(4, bs, 2, 2 * D))
    kc, vc = wide_k[..., :D], wide_v[..., :D]
    ref_k, ref_v = host(kc).clone(), host(vc).clone()
    g = torch.Generator().manual_seed(9)
    key, val = torch.randn(3, 2, D, generator=g), torch.randn(3, 2, D, generator=g)
    backend.write_kv(*put(backend, key, val), kc, vc, put(backend, torch.tensor([1, bs + 2, 7])))
    for t, s in enumerate([1, bs + 2, 7]):
        ref_k[s // bs, s % bs], ref_v[s // bs, s % bs] = key[t], val[t]
    backend.copy_kv(kc, vc, *put(backend, torch.tensor([1, 7]), torch.tensor([2, 3])))
    ref_k[0, 2:4], ref_v[0, 2:4] = ref_k[0, [1, 7]].clone(), ref_v[0, [1, 7]].clone()
    assert torch.equal(host(kc), ref_k) and torch.equal(host(vc), ref_v)
    assert torch.equal(host(wide_k)[..., D:].abs().sum() > 0, torch.tensor(True)), "the padding is untouched"
    q = put(backend, torch.randn(2, 4, D, generator=g))
    bt = put(backend, torch.tensor([[0, 1]], dtype=torch.int32))
    args = (bt, put(backend, torch.tensor([bs + 3])), put(backend, torch.tensor([0, 2])), D ** -0.5)
    padded = backend.paged_attention(q, kc, vc, *args)
    packed = backend.paged_attention(q, kc.contiguous(), vc.contiguous(), *args)
    torch.testing.assert_close(host(padded), host(packed), atol=1e-5, rtol=0)


# -- item 8: tiny temperatures are greedy; extreme finite logits never overflow ----------------

EXTREMES = [
    (1e-45, [1.0, 2.0, 0.5], 1, [0.0, 1.0, 0.0]),            # denormal T: greedy
    (9e-6, [1.0, 1.0 + 1e-6, 0.5], 1, [0.0, 1.0, 0.0]),      # below SAMPLING_EPS: greedy
    (0.5, [3e38, -3e38, 1e37], 0, [1.0, 0.0, 0.0]),          # (x - max) / T: no inf - inf
    (0.5, [-3e38, -3.3e38, -3e38], None, [0.5, 0.0, 0.5]),   # near -FLT_MAX, a tie
    (0.25, [3.3e38, 3.3e38, -3.3e38], None, [0.5, 0.5, 0.0]),
]


@pytest.mark.hal_op("sample")
@pytest.mark.parametrize("temperature,logits,token,q", EXTREMES)
def test_tiny_temperature_and_extreme_logits(backend, temperature, logits, token, q):
    R = 400
    lg = torch.tensor([logits]).expand(R, 3)
    tok, qq = backend.sample(*put(backend, lg, torch.full((R,), temperature), torch.zeros(R, dtype=torch.int32),
                                  torch.ones(R), torch.arange(R), torch.zeros(R, dtype=I64)))
    tok, qq = host(tok), host(qq)
    assert not torch.isnan(qq).any(), "q holds NaN"
    torch.testing.assert_close(qq, torch.tensor([q]).expand(R, 3), atol=1e-6, rtol=0)
    if token is not None:
        assert (tok == token).all()
    else:
        allowed = torch.tensor(q) > 0
        assert allowed[tok.long()].all() and len(set(tok.tolist())) == 2, "both tied tokens are drawn"


@pytest.mark.hal_op("verify_rejection_logits")
@pytest.mark.parametrize("temperature,logits,token,q", EXTREMES)
def test_tiny_temperature_and_extreme_logits_in_verify(backend, temperature, logits, token, q):
    """The same rows as target logits (no drafts: the bonus token): drawn from q, never NaN."""
    R = 400
    out, n = host(*backend.verify_rejection_logits(*put(backend, torch.zeros(0, dtype=I64), torch.zeros(R + 1, dtype=I64),
                                                        None, torch.tensor([logits]).expand(R, 3),
                                                        torch.full((R,), temperature), torch.arange(R),
                                                        torch.zeros(R, dtype=I64)), 0))
    tok = out[:, 0]
    if token is not None:
        assert (tok == token).all()
    else:
        allowed = torch.tensor(q) > 0
        assert allowed[tok.long()].all() and len(set(tok.tolist())) == 2, "both tied tokens are drawn"


# -- item 12: draft probabilities slightly above 1 are used literally ---------------------------

@pytest.mark.hal_op("verify_rejection")
def test_draft_prob_above_one_is_used_literally(backend):
    """q(x) = 1.0009 (inside the 1e-3 sum tolerance), p(x) = 1: accept iff u * 1.0009 < 1, so
    about 9e-4 of the drafts are rejected (vLLM's rule; capping q at 1 would reject none). A
    rejection recovers from max(p - q, 0) = 0, i.e. from p: the emitted token is still 0."""
    R, V, qx = 60_000, 4, 1.0009
    target = torch.zeros(2 * R, V)
    target[:, 0] = 1.0
    draft = torch.zeros(R, V)
    draft[:, 0] = qx
    seeds, offsets = torch.arange(R) * 7 + 1, torch.full((R,), 4)
    out, n = backend.verify_rejection(*put(backend, torch.zeros(R, dtype=I64), torch.arange(R + 1), draft, target,
                                           seeds, offsets), 1)
    out, n = host(out), host(n)
    assert (out[:, 0] == 0).all()
    rejected, expect = int((n == 0).sum()), R * (1 - 1 / qx)
    sd = math.sqrt(expect)
    assert abs(rejected - expect) < 6 * sd, f"{rejected} rejections, expected {expect:.0f} +- {6 * sd:.0f} (6 sd)"


# -- aliasing: k_cache and v_cache may share an allocation, not memory --------------------------

@pytest.mark.hal_op("write_kv", "copy_kv")
def test_kv_caches_in_one_allocation(backend):
    """vLLM's layout: one [2, blocks, ...] tensor, k = kv[0], v = kv[1] (and an interleaved
    [blocks, 2, ...] variant): both work; passing the same cache twice is refused."""
    bs = bs_of(backend)
    key, val = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    for kv, k_of, v_of in ((torch.zeros(2, 3, bs, 2, 16), lambda t: t[0], lambda t: t[1]),
                           (torch.zeros(3, 2, bs, 2, 16), lambda t: t[:, 0], lambda t: t[:, 1])):
        kv = put(backend, kv)
        backend.write_kv(*put(backend, key, val), k_of(kv), v_of(kv), put(backend, torch.tensor([0, bs + 1])))
        backend.copy_kv(k_of(kv), v_of(kv), *put(backend, torch.tensor([0]), torch.tensor([2])))
        h = host(kv)
        assert torch.equal(k_of(h)[0, 0], key[0]) and torch.equal(v_of(h)[1, 1], val[1])
        assert torch.equal(k_of(h)[0, 2], key[0]) and torch.equal(v_of(h)[0, 2], val[0])
    kc = put(backend, torch.zeros(2, bs, 2, 16))
    with pytest.raises(hal.HalError) as e:
        backend.write_kv(*put(backend, key, val), kc, kc, put(backend, torch.tensor([0, 1])))
    assert e.value.arg == "v_cache"
