"""Batch invariance of the runner (`hal.models.invariant`): a token's logits are bit-identical
whether it is decoded alone, verified among k others, or batched with other requests, at the
bundled model's shapes (hidden 576, 9 query / 3 KV heads of 64, ffn 1536, vocab 49152; random
weights, 2 layers). Every layer kind is checked on its own, then the whole forward, for the
linear plan this machine chose (`hal.models.linear_plan`) at each dtype it offers. The same
comparisons on the plain path (``F.linear``, the backend's attention) show differences, so
the tests can fail."""

from __future__ import annotations

import pytest
import torch

import hal
from hal.models.llama import random_llama
from hal.engine.forward import forward
from hal.kv import KVPool
from hal.models import invariant
from hal.models.linear_plan import choose_plan, offered_dtypes
from hal.models.llama import Llama
from hal.models.row_kernels import FusedRows

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]   # qkv, o, gate-up, down, lm_head
HERE = offered_dtypes()   # float32 (+ bfloat16)


@pytest.mark.parametrize("dtype", HERE)
@pytest.mark.parametrize("N,K", SHAPES)
def test_linear_rows_do_not_depend_on_the_batch(N, K, dtype):
    plan = choose_plan(SHAPES, dtype).plan
    g = torch.Generator().manual_seed(N + K)
    w = (torch.randn(N, K, generator=g) * 0.05).to(plan.dtype)
    x = torch.randn(1, K, generator=g)
    alone = plan.linear(x, w)
    for T in (2, 3, 4, 5, 8, 9, 13, 17):
        for pos in (0, T // 2, T - 1):
            batch = torch.randn(T, K, generator=g)
            batch[pos] = x[0]
            assert torch.equal(plan.linear(batch, w)[pos], alone[0]), \
                f"{plan.describe()}: row {pos} of {T} differs from alone"


def test_plain_linear_is_not_batch_invariant():
    """The teeth: the layout it replaces gives a different row at M = 9 on this machine."""
    g = torch.Generator().manual_seed(1)
    diffs = []
    for N, K in SHAPES:
        w = torch.randn(N, K, generator=g) * 0.05
        x = torch.randn(9, K, generator=g)
        diffs.append(float((torch.nn.functional.linear(x, w)[4] - torch.nn.functional.linear(x[4:5], w)[0]).abs().max()))
    assert max(diffs) > 0, "F.linear was batch-invariant here: the invariance tests would prove nothing"


def _cache(g, blocks=12, bs=16, Hkv=3, D=64):
    return torch.randn(blocks, bs, Hkv, D, generator=g), torch.randn(blocks, bs, Hkv, D, generator=g)


def attention(q, kc, vc, bt, seq, qsl, scale, max_query):
    return invariant.attention(q, kc, vc, invariant.Plan(bt, seq, qsl, q.shape[0], kc.shape[1], max_query), scale)


def test_attention_query_does_not_depend_on_the_batch():
    """The query at position 40: decoded alone (q_len 1), as query 5 of a 9-token verify, and
    in a batch beside a longer request whose block table is wider: the same bits."""
    g = torch.Generator().manual_seed(2)
    kc, vc = _cache(g)
    q_t = torch.randn(1, 9, 64, generator=g)
    bt = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    alone = attention(q_t, kc, vc, bt, torch.tensor([41]), torch.tensor([0, 1]), 0.125, 1)
    qv = torch.randn(9, 9, 64, generator=g)
    qv[5] = q_t[0]
    verify = attention(qv, kc, vc, bt, torch.tensor([44]), torch.tensor([0, 9]), 0.125, 9)
    assert torch.equal(verify[5], alone[0])
    other = torch.randn(3, 9, 64, generator=g)
    mixed_q = torch.cat([other, qv])
    bt2 = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11],
                        [0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    mixed = attention(mixed_q, kc, vc, bt2, torch.tensor([140, 44]), torch.tensor([0, 3, 12]), 0.125, 9)
    assert torch.equal(mixed[3 + 5], alone[0])
    torch.testing.assert_close(alone, _reference(q_t, kc, vc, bt, torch.tensor([41]), torch.tensor([0, 1])),
                               atol=1e-5, rtol=0)


def _reference(q, kc, vc, bt, seq, qsl):
    be = hal.get_backend("cpu")
    return be.paged_attention(q, kc, vc, bt, seq, qsl, 0.125)


def test_attention_matches_the_contract_on_ragged_batches():
    g = torch.Generator().manual_seed(3)
    kc, vc = _cache(g)
    q = torch.randn(1 + 9 + 3, 9, 64, generator=g)
    bt = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0], [7, 8, 9, 10]], dtype=torch.int32)
    seq, qsl = torch.tensor([17, 40, 64]), torch.tensor([0, 1, 10, 13])
    torch.testing.assert_close(attention(q, kc, vc, bt, seq, qsl, 0.125, 9),
                               _reference(q, kc, vc, bt, seq, qsl), atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=[(d, f) for d in HERE for f in (True, False)],
                ids=lambda p: f"{p[0]}-{'fused' if p[1] else 'eager'}")
def model(request):   # SmolLM2-135M's shapes, 2 layers, at each dtype this machine offers, rows fused and eager
    dtype, fused = request.param
    m = random_llama(576, 2, 9, 3, 64, 1536, 49152, seed=4, scale=0.05, embed_scale=0.5, dtype=dtype,
                     fused_rows=fused)
    assert isinstance(m.rows, FusedRows) == fused, "the fused row kernels did not build here"
    return m


PROMPT = [(7 * i + 3) % 49152 for i in range(21)]
TOKENS = [11, 2024, 7, 7, 40000, 3, 99, 512, 6]


def _decoded_alone(model):
    pool = KVPool(model.be, 32, 16, 3, 64, dtype=model.dtype, num_layers=2)
    s = pool.sequence()
    logits = [forward(model, pool, [s], [PROMPT], False)[0][0]]
    s.commit(len(PROMPT))
    for t in TOKENS:
        logits.append(forward(model, pool, [s], [[t]], False)[0][0])
        s.commit(1)
    return torch.stack(logits)


def _verified(model, k, neighbour):
    """Prefill, then one forward over TOKENS[:k] (all rows), optionally beside another request."""
    pool = KVPool(model.be, 32, 16, 3, 64, dtype=model.dtype, num_layers=2)
    s, o = pool.sequence(), pool.sequence()
    first = forward(model, pool, [s], [PROMPT], False)[0][0]
    s.commit(len(PROMPT))
    if neighbour:
        forward(model, pool, [o], [list(range(50, 90))], False)
        o.commit(40)
        out = forward(model, pool, [o, s], [[5, 6, 7], TOKENS[:k]], True)[0][3:]
    else:
        out = forward(model, pool, [s], [TOKENS[:k]], True)[0]
    return torch.cat([first[None], out])


@pytest.mark.parametrize("k,neighbour", [(4, False), (9, False), (5, True)])
def test_forward_rows_do_not_depend_on_the_batch(model, k, neighbour):
    alone = _decoded_alone(model)
    assert torch.equal(_verified(model, k, neighbour), alone[:k + 1]), "a verified row differs from its decode"


def test_plain_forward_is_not_batch_invariant(model):
    if model.dtype != torch.float32:
        pytest.skip("the float32 plain path is the tooth here; other dtypes get the planted leak below")
    plain = Llama(model.cfg, model.w, model.be, batch_invariant=False)
    assert not torch.equal(_verified(plain, 9, False), _decoded_alone(plain)), \
        "the plain runner was batch-invariant here: the forward test would prove nothing"


def test_a_planted_leak_between_rows_breaks_the_forward_test(model):
    """PLANTED: a linear layout whose rows see their chunk-mates (5% of their mean) fails
    the forward comparison at this dtype (so passing it means something)."""
    from hal.models.linear_layout import LAYOUTS, LinearPlan

    def leak(x, w):
        return LAYOUTS["mm"](x, w) + (0.05 * x.float().mean()).to(x.dtype)
    leaky = Llama(model.cfg, model.w, model.be, plan=LinearPlan("leak", model.dtype, (16,), fn=leak))
    assert not torch.equal(_verified(leaky, 9, False), _decoded_alone(leaky))


def test_serving_flag_turns_it_off():
    import argparse

    from hal.launch.flags import add_engine_args
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert ap.parse_args([]).batch_invariant is True
    assert ap.parse_args(["--no-batch-invariant"]).batch_invariant is False


PARENTS = [-1, -1, 0, 0, 2, 1, 4]     # a 7-node tree: two children of the root, a depth-4 path


LONG = [(5 * i + 1) % 49152 for i in range(300)]   # past one 256-key block: context blocks are not gathered


def _tree_rows(model, neighbour: bool, prompt=PROMPT):
    """Prefill PROMPT[:-1], then one tree forward over [PROMPT[-1], TOKENS[:7]] with PARENTS
    (optionally after another request's prefill chunk in the same batch): every fed row's logits."""
    from hal.engine import trees
    from hal.engine.forward import forward_tokens
    pool = KVPool(model.be, 32, 16, 3, 64, dtype=model.dtype, num_layers=2)
    s, o = pool.sequence(), pool.sequence()
    forward(model, pool, [s], [prompt[:-1]], False)
    s.commit(len(prompt) - 1)
    parents = torch.tensor(PARENTS)
    seqs, extra, fed = [s], [], [prompt[-1]] + TOKENS[:7]
    if neighbour:
        seqs, extra, fed = [s, o], [13], fed + list(range(60, 73))
    depth, mask = trees.layout(parents, [7], extra, torch.device("cpu"))
    logits, _ = forward_tokens(model, pool, seqs, [8] + extra, torch.tensor(fed), all_rows=True,
                               tree_mask=mask, depth=depth)
    return logits[:8]


def _path_decoded(model, node: int, prompt=PROMPT):
    """The logits of node ``node`` when its path is decoded one token at a time after PROMPT."""
    path, n = [], node
    while n >= 0:
        path.insert(0, TOKENS[n])
        n = PARENTS[n]
    pool = KVPool(model.be, 32, 16, 3, 64, dtype=model.dtype, num_layers=2)
    s = pool.sequence()
    out = forward(model, pool, [s], [prompt], False)[0][0]
    s.commit(len(prompt))
    for t in path:
        out = forward(model, pool, [s], [[t]], False)[0][0]
        s.commit(1)
    return out


@pytest.mark.parametrize("neighbour,prompt", [(False, PROMPT), (True, PROMPT), (False, LONG)])
def test_tree_rows_equal_their_paths_decoded(model, neighbour, prompt):
    """A tree verify's node rows are the bits of decoding each node's path as a chain (scores
    and values in chain order; positions context + depth), also beside a prefill chunk and
    after a context longer than one key block."""
    rows = _tree_rows(model, neighbour, prompt)
    for node in range(-1, len(PARENTS)):
        assert torch.equal(rows[1 + node], _path_decoded(model, node, prompt)), f"node {node} differs from its path"


def test_tree_attention_needs_chain_order(model, monkeypatch):
    """The teeth: masking the same keys where they lie (no gather into chain order) changes
    some node's bits, so the test above can fail. Attention runs in float32 at every dtype;
    at bfloat16 its output is rounded before the next linear layer, which hides the order's last
    bits, so the tooth is shown at float32."""
    if model.dtype != torch.float32:
        pytest.skip("attention is float32 at every dtype; its tooth is shown on the float32 model")
    if isinstance(model.rows, FusedRows):
        real_lists = invariant.KeyLists.__init__

        def reversed_steps(self, *args, **kw):   # a node's visible step keys last to first
            real_lists(self, *args, **kw)
            for t, n in enumerate(self.n_extra.tolist()):
                self.extra[t, :n] = self.extra[t, :n].flip(0)
        monkeypatch.setattr(invariant.KeyLists, "__init__", reversed_steps)
        rows = _tree_rows(model, False)
        assert not all(torch.equal(rows[1 + n], _path_decoded(model, n)) for n in range(len(PARENTS))), \
            "step keys out of chain order gave the chain's bits: the tree test would prove nothing"
        return
    real = invariant.Plan.__init__

    def in_place(self, bt, seq, qsl, T, bs, max_query, tree_mask=None, min_context=0, slot_mapping=None, seq_ends=None):
        real(self, bt, seq, qsl, T, bs, max_query, tree_mask, min_context, slot_mapping, seq_ends)
        if tree_mask is None:
            return
        ctx = seq.long() - (qsl[1:] - qsl[:-1]).long()
        j = torch.arange(self.Lp + max_query)
        for i, (n, rows, valid, see, dest, order) in enumerate(self.chunks):
            m = tree_mask[rows][..., :max_query]
            vis = (j < ctx[:, None, None]).expand(*m.shape[:2], -1).clone()
            vis.scatter_(2, ctx[:, None, None] + torch.arange(max_query).expand_as(m), m)
            see = vis[..., :self.Lp] | ~valid[..., 0, 0][..., None]
            self.chunks[i] = (n, rows, valid, see[:, None, :, None], dest, None)

    monkeypatch.setattr(invariant.Plan, "__init__", in_place)
    rows = _tree_rows(model, False)
    assert not all(torch.equal(rows[1 + n], _path_decoded(model, n)) for n in range(len(PARENTS))), \
        "masking in place gave the chain's bits: the tree test would prove nothing"


def test_host_kv_writes_equal_the_backend_op_and_skip_padding():
    """`invariant.write_kv` (layers after the first, host tensors) writes what the backend's
    ``write_kv`` writes, leaves padding slots (-1) untouched, and steps aside for a strided cache."""
    g = torch.Generator().manual_seed(11)
    be = hal.get_backend("cpu")
    kc, vc = _cache(g)
    key, value = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    slots = torch.tensor([3, -1, 40, 17, -1])
    bt, seq, qsl = torch.tensor([[0, 1, 2]]), torch.tensor([41]), torch.tensor([0, 5])
    plan = invariant.Plan(bt, seq, qsl, 5, kc.shape[1], 5, slot_mapping=slots)
    want_k, want_v = kc.clone(), vc.clone()
    be.write_kv(key, value, want_k, want_v, slots)
    assert invariant.write_kv(plan, key, value, kc, vc)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    strided = torch.randn(12, 3, 16, 64, generator=g).transpose(1, 2)   # [blocks, bs, Hkv, D], not contiguous
    before = strided.clone()
    assert not invariant.write_kv(plan, key, value, strided, strided.clone())
    assert torch.equal(strided, before)


@pytest.mark.parametrize("lens", [[1, 1, 1], [3, 1, 4]])   # decode-only, and ragged verifies
def test_values_past_each_end_are_zeroed_by_host_lengths_as_by_the_mask(lens):
    """With the lengths on the host (``seq_ends``) the values past each sequence's end are
    zeroed by one fill per request instead of the broadcast mask: the same bits, and no NaN of
    a reused block reaches the output. PLANTED: ends one past the truth let a NaN through."""
    g = torch.Generator().manual_seed(5)
    kc, vc = _cache(g)
    seq = torch.tensor([40, 17, 70])
    bt = torch.tensor([[0, 1, 2, 0, 0], [3, 4, 0, 0, 0], [5, 6, 7, 8, 9]])
    for c in (kc, vc):   # NaN past each end (40, 17, 70: in blocks 2, 4, 9) and in the unused blocks
        c[2, 8:], c[4, 1:], c[9, 6:], c[10:] = float("nan"), float("nan"), float("nan"), float("nan")
    qsl = torch.tensor([0, *lens]).cumsum(0)
    q = torch.randn(int(qsl[-1]), 9, 64, generator=g)
    args = (bt, seq, qsl, q.shape[0], kc.shape[1], max(lens))
    masked = invariant.attention(q, kc, vc, invariant.Plan(*args), 0.125)
    filled = invariant.attention(q, kc, vc, invariant.Plan(*args, seq_ends=tuple(seq.tolist())), 0.125)
    assert torch.isfinite(masked).all() and torch.equal(masked, filled)
    late = invariant.Plan(*args, seq_ends=tuple(n + 1 for n in seq.tolist()))   # PLANTED: one position too many
    assert not torch.isfinite(invariant.attention(q, kc, vc, late, 0.125)).all()
