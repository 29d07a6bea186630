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


def _parents(g, ks, it):
    """A random tree per request: each node's parent an earlier node or the root (-1)."""
    if not sum(ks):
        return torch.zeros(0, dtype=it)
    return torch.cat([torch.randint(-1, max(i, 0), (1,), generator=g) if i else torch.tensor([-1])
                      for k in ks for i in range(k)]).to(it)


def processors(g, ids, cu, logits, parents, max_k: int, groups: dict, it=torch.int64) -> dict:
    """A valid `process_logits` call: the processor groups named true in ``groups``, with
    random (often repeated) tokens so that penalties, bad words and stops do hit the drafts."""
    R, V = cu.shape[0] - 1, logits.shape[1]
    none = dict(penalties=None, token_counts=None, prompt_mask=None, bias=None, bad_words=None,
                bad_word_owner=None, history=None, stop_ids=None, min_tokens=None, min_p=None)
    args = dict(logits=logits, draft_token_ids=ids, cu_num_draft_tokens=cu, parent_ids=parents, **none)
    if groups.get("penalties"):
        pen = torch.stack([torch.rand(R, generator=g) * 2 - 0.5, torch.rand(R, generator=g) * 2 - 0.5,
                           torch.rand(R, generator=g) * 1.5 + 0.5], 1)
        args.update(penalties=pen, token_counts=torch.randint(0, 3, (R, V), generator=g).to(it)
                    * (torch.rand(R, V, generator=g) < 0.3), prompt_mask=torch.rand(R, V, generator=g) < 0.3)
    if groups.get("bias"):
        bias = torch.randn(R, V, generator=g) * (torch.rand(R, V, generator=g) < 0.3)
        bias[(torch.rand(R, V, generator=g) < 0.2) & (torch.arange(V) > 0)] = -math.inf   # allowed ids
        args.update(bias=bias)
    if groups.get("bad_words"):
        W, L, H = int(torch.randint(0, 5, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g)), 3
        words = torch.randint(0, min(V, 3), (W, L), generator=g)
        lens = torch.randint(1, L + 1, (W,), generator=g)
        words[torch.arange(L)[None] < (L - lens)[:, None]] = -1
        hist = torch.randint(0, min(V, 3), (R, H), generator=g)
        hist[torch.arange(H)[None] < torch.randint(0, H + 1, (R, 1), generator=g)] = -1
        args.update(bad_words=words.to(it), bad_word_owner=torch.randint(0, max(R, 1), (W,), generator=g).to(it)
                    if R else torch.zeros(0, dtype=it), history=hist.to(it))
        if not R:
            args.update(bad_words=words[:0].to(it))
    if groups.get("min_tokens"):
        stops = torch.randint(-1, V, (R, 2), generator=g)
        args.update(stop_ids=stops.to(it), min_tokens=torch.randint(0, max_k + 2, (R,), generator=g).to(it))
    if groups.get("min_p"):
        temp = torch.rand(R, generator=g) * 2
        temp[torch.rand(R, generator=g) < 0.3] = 0
        args.update(min_p=torch.stack([torch.rand(R, generator=g) * (torch.rand(R, generator=g) < 0.7), temp], 1))
    return {**args, "max_k": max_k}


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
    if op == "process_logits":
        parents = _parents(g, ks, it) if draw(st.booleans()) else None
        groups = {name: draw(st.booleans()) for name in ("penalties", "bias", "bad_words", "min_tokens", "min_p")}
        return processors(g, ids, cu, _logits(g, N + R, V, ft, zeros), parents, max_k, groups, it), V
    return _kv_case(draw, g, be, op, R, it, ft), V


def _kv_case(draw, g, be, op: str, R: int, it, ft) -> dict:
    """The args of a valid ``write_kv``, ``copy_kv`` or ``paged_attention`` call."""
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
                    **caches, slot_mapping=slots.to(it))
    if op == "copy_kv":
        M = draw(st.integers(0, min(6, nslots)))
        return dict(**caches, src_slots=torch.randint(0, nslots, (M,), generator=g).to(it),
                    dst_slots=torch.randperm(nslots, generator=g)[:M].to(it))
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
                scale=D ** -0.5, tree_mask=tm)
