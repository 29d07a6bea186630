"""The fuzz suite's valid cases: for each op, a hypothesis strategy drawing a valid call on a
backend's device (edge sizes, every dtype, -inf logits, padding slots, ...), with the host values."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from hal.conformance._helpers import bs_of

FLOAT = st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float64])
INT = st.sampled_from([torch.int64, torch.int32])


def _probs(g, rows, V, dtype, zeros):
    p = torch.rand(rows, V, generator=g, dtype=torch.float64) ** 3
    p = p.masked_fill(torch.rand(rows, V, generator=g) < zeros, 0)
    p[:, 0] += 1e-3
    return (p / p.sum(-1, keepdim=True)).to(dtype)


def _logits(g, rows, V, dtype, masked):
    x = (torch.randn(rows, V, generator=g, dtype=torch.float64) * 4).to(dtype)
    if dtype in (torch.float16, torch.bfloat16):
        x = x.round()   # coarse values: exact ties
    m = torch.rand(rows, V, generator=g) < masked
    m[:, 0] = False
    return x.masked_fill(m, -math.inf)


@st.composite
def valid_case(draw, be, op):
    """``(args dict, V)`` of a valid call of ``op`` on ``be``'s device (values on the host)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    R = draw(st.sampled_from([0, 1, 1, 2, 3, 5]))
    V = draw(st.sampled_from([1, 2, 3, 8, 33]))
    ks = [draw(st.integers(0, 4)) for _ in range(R)]
    max_k = max(ks, default=0) + draw(st.sampled_from([0, 0, 1, 3]))
    N, it, ft = sum(ks), draw(INT), draw(FLOAT)
    ids = torch.randint(0, V, (N,), generator=g).to(it)
    cu = torch.tensor([0] + ks).cumsum(0).to(it)
    so = dict(seeds=torch.randint(-2 ** 62, 2 ** 62, (R,), generator=g),
              offsets=torch.randint(0, 2 ** 40, (R,), generator=g))
    zeros = draw(st.sampled_from([0.0, 0.5]))
    if op == "sample":
        temp = torch.rand(R, generator=g) * 2
        temp[torch.rand(R, generator=g) < 0.3] = 0
        return dict(logits=_logits(g, R, V, ft, zeros), temperature=temp,
                    top_k=torch.randint(-1, V + 2, (R,), generator=g).to(torch.int32),
                    top_p=torch.rand(R, generator=g).clamp(min=0.05).where(torch.rand(R, generator=g) < 0.5,
                                                                            torch.ones(R)), **so), V
    if op == "ngram_propose":
        L = draw(st.sampled_from([0, 1, 4, 12]))
        hist = torch.randint(0, draw(st.sampled_from([2, 3, 50])), (R, L), generator=g).to(it)
        n = draw(st.integers(1, 6))
        lo = draw(st.integers(1, n))
        return dict(token_ids=hist, num_tokens=torch.randint(0, L + 1, (R,), generator=g).to(draw(INT)),
                    min_n=lo, max_n=n, k=draw(st.integers(1, 6))), V
    if op == "verify_greedy":
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, target_logits=_logits(g, N + R, V, ft, zeros),
                    max_k=max_k), V
    if op == "verify_rejection":
        dp = _probs(g, N, V, ft, zeros) if draw(st.booleans()) else None
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, draft_probs=dp,
                    target_probs=_probs(g, N + R, V, ft, zeros), **so, max_k=max_k), V
    if op == "verify_rejection_logits":
        dp = _probs(g, N, V, ft, zeros) if draw(st.booleans()) else None
        temp = torch.rand(R, generator=g) * 2
        temp[torch.rand(R, generator=g) < 0.4] = 0
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, draft_probs=dp,
                    target_logits=_logits(g, N + R, V, ft, zeros), temperature=temp, **so, max_k=max_k), V
    if op == "verify_typical":
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, target_probs=_probs(g, N + R, V, ft, zeros), **so,
                    max_k=max_k, posterior_threshold=draw(st.sampled_from([0.09, 0.3, 1.0])),
                    posterior_alpha=draw(st.sampled_from([0.3, 1.0]))), V
    if op == "verify_tree":
        parents = torch.cat([torch.randint(-1, max(i, 0), (1,), generator=g) if i else torch.tensor([-1])
                             for k in ks for i in range(k)]).to(it) if N else torch.zeros(0, dtype=it)
        if draw(st.booleans()):
            return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, parent_ids=parents,
                        target=_logits(g, N + R, V, ft, zeros), draft_probs=None, seeds=None, offsets=None,
                        max_k=max_k), V
        dp = _probs(g, N, V, ft, zeros) if draw(st.booleans()) else None
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, parent_ids=parents,
                    target=_probs(g, N + R, V, ft, zeros), draft_probs=dp, **so, max_k=max_k), V
    bs = bs_of(be)
    nb = draw(st.integers(1, 4))
    H, D = draw(st.sampled_from([1, 2])), 16
    cdt = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    caches = dict(k_cache=torch.randn(nb, bs, H, D, generator=g).to(cdt),
                  v_cache=torch.randn(nb, bs, H, D, generator=g).to(cdt))
    nslots = nb * bs
    if op == "write_kv":
        T = draw(st.integers(0, min(6, nslots)))
        slots = torch.randperm(nslots, generator=g)[:T]
        slots[torch.rand(T, generator=g) < 0.3] = -1
        return dict(key=torch.randn(T, H, D, generator=g).to(ft), value=torch.randn(T, H, D, generator=g).to(ft),
                    **caches, slot_mapping=slots.to(it)), V
    if op == "copy_kv":
        M = draw(st.integers(0, min(6, nslots)))
        return dict(**caches, src_slots=torch.randint(0, nslots, (M,), generator=g).to(it),
                    dst_slots=torch.randperm(nslots, generator=g)[:M].to(it)), V
    assert op == "paged_attention"
    width = draw(st.integers(1, 3))
    seq = torch.randint(1, width * bs + 1, (R,), generator=g)
    ql = torch.minimum(torch.randint(1, 5, (R,), generator=g), seq)
    if draw(st.booleans()):
        ql = torch.ones(R, dtype=torch.long)        # decode
    T = int(ql.sum())
    bt = torch.randint(0, nb, (R, width), generator=g).to(torch.int32)
    bt[:, 1:] = torch.where(torch.rand(R, width - 1, generator=g) < 0.2, 10 ** 6, bt[:, 1:])   # unused: never read
    used = torch.arange(width)[None] * bs < seq[:, None]
    bt = torch.where(used, bt.clamp(max=nb - 1), bt)
    tm = None
    if draw(st.booleans()) and R:
        tm = torch.rand(T, int(ql.max()), generator=g) < 0.5
        qs = torch.cat([torch.zeros(1, dtype=torch.long), ql.cumsum(0)])
        for r in range(R):
            tm[qs[r]:qs[r + 1], :int(ql[r])] |= torch.eye(int(ql[r]), dtype=torch.bool)
    return dict(query=torch.randn(T, H * draw(st.sampled_from([1, 2])), D, generator=g).to(cdt), **caches,
                block_tables=bt, seq_lens=seq.to(it), query_start_loc=torch.cat([torch.zeros(1), ql.cumsum(0)]).to(it),
                scale=D ** -0.5, tree_mask=tm), V
