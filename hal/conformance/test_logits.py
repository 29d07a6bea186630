"""`process_logits`: every processor equals a row-by-row oracle written from the contract
(Python loops over each row's path), on chains and trees, and each row counts the drafts
before it. Tolerance: processed logits equal within atol 1e-5, rtol 1e-5 (float32 ops in
a different order), and the ``-inf`` positions exactly."""

from __future__ import annotations

import math

import pytest
import torch

from hal.conformance._cases import processors
from hal.ops import SAMPLING_EPS

GROUPS = ("penalties", "bias", "bad_words", "min_tokens", "min_p")


def _path(parents, cu, r, j):
    """Tokens' global indices on the path of row j of request r, newest first."""
    if j == 0:
        return []
    out, node = [], j - 1
    while node >= 0:
        out.append(int(cu[r]) + node)
        node = node - 1 if parents is None else int(parents[int(cu[r]) + node])
    return out


def oracle(a: dict) -> torch.Tensor:
    """The contract, one row at a time."""
    logits, ids, cu, parents = a["logits"].cpu(), a["draft_token_ids"].cpu(), a["cu_num_draft_tokens"].cpu(), \
        None if a["parent_ids"] is None else a["parent_ids"].cpu()
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    R = cu.shape[0] - 1
    out = torch.empty(logits.shape, dtype=torch.float32)
    for r in range(R):
        for j in range(int(cu[r + 1] - cu[r]) + 1):
            row = int(cu[r]) + r + j
            path = [int(ids[i]) for i in _path(parents, cu, r, j)]
            x = logits[row].float().clone()
            if cpu["bias"] is not None:
                x += cpu["bias"][r]
            if cpu["bad_words"] is not None:
                ctx = [int(t) for t in cpu["history"][r] if t >= 0] + path[::-1]
                for w, owner in zip(cpu["bad_words"], cpu["bad_word_owner"]):
                    toks = [int(t) for t in w if t >= 0]
                    if int(owner) == r and toks and (len(toks) == 1 or ctx[-(len(toks) - 1):] == toks[:-1]):
                        x[toks[-1]] = -math.inf
            if cpu["stop_ids"] is not None and len(path) < int(cpu["min_tokens"][r]):
                for s in cpu["stop_ids"][r]:
                    if s >= 0:
                        x[int(s)] = -math.inf
            if cpu["penalties"] is not None:
                freq, pres, rep = (float(v) for v in cpu["penalties"][r])
                c = cpu["token_counts"][r].long().clone()
                for t in path:
                    c[t] += 1
                seen = cpu["prompt_mask"][r] | (c > 0)
                x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
                x = x - freq * c - pres * (c > 0)
            if cpu["min_p"] is not None:
                mp, temp = (float(v) for v in cpu["min_p"][r])
                if temp >= SAMPLING_EPS and mp > 0:
                    x = torch.where(x < x.max() + temp * math.log(mp), -math.inf, x)
            out[row] = x
    return out


def _case(seed: int, groups: dict, tree: bool, R: int = 3, V: int = 12):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, 5, (R,), generator=g).tolist()
    cu = torch.tensor([0] + ks).cumsum(0)
    ids = torch.randint(0, 3, (sum(ks),), generator=g)   # few distinct tokens: repeats on every path
    parents = None
    if tree:
        parents = torch.cat([torch.randint(-1, max(i, 0), (1,), generator=g) if i else torch.tensor([-1])
                             for k in ks for i in range(k)]) if sum(ks) else torch.zeros(0, dtype=torch.long)
    logits = torch.randn(sum(ks) + R, V, generator=g) * 3
    return processors(g, ids, cu, logits, parents, max(ks, default=0), groups)


def _check(backend, a):
    dev = backend.device_type
    got = backend.process_logits(*({k: v.to(dev) if isinstance(v, torch.Tensor) else v
                                    for k, v in a.items()}).values()).cpu()
    want = oracle(a)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "the -inf positions differ"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", GROUPS + ("all",))
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_equals_the_row_by_row_oracle(backend, group, tree):
    for seed in range(12):
        groups = {g: group in (g, "all") for g in GROUPS}
        _check(backend, _case(seed, groups, tree))


def test_no_processor_is_the_identity(backend):
    a = _case(0, {}, False)
    got = backend.process_logits(*({k: v.to(backend.device_type) if isinstance(v, torch.Tensor) else v
                                    for k, v in a.items()}).values())
    assert torch.equal(got.cpu(), a["logits"].float())


def _one(ids, k_drafts, V=8, **groups):
    cu = torch.tensor([0, k_drafts])
    base = dict(logits=torch.zeros(k_drafts + 1, V), draft_token_ids=torch.tensor(ids, dtype=torch.long),
                cu_num_draft_tokens=cu,
                parent_ids=None, penalties=None, token_counts=None, prompt_mask=None, bias=None, bad_words=None,
                bad_word_owner=None, history=None, stop_ids=None, min_tokens=None, min_p=None, max_k=k_drafts)
    return {**base, **groups}


def test_penalties_count_the_drafts_before_each_row(backend):
    """Drafts [5, 5]: token 5 has been generated 0, 1 and 2 times at the three rows."""
    a = _one([5, 5], 2, penalties=torch.tensor([[1.0, 0.5, 1.0]]), token_counts=torch.zeros(1, 8, dtype=torch.long),
             prompt_mask=torch.zeros(1, 8, dtype=torch.bool))
    got = backend.process_logits(*({k: v.to(backend.device_type) if isinstance(v, torch.Tensor) else v
                                    for k, v in a.items()}).values()).cpu()
    assert got[:, 5].tolist() == [0.0, -1.5, -2.5]
    _check(backend, a)


def test_bad_words_read_the_draft_prefix(backend):
    """Bad word (1, 2): banned after a draft 1, not at the root (the history ends with 3)."""
    a = _one([1, 2], 2, bad_words=torch.tensor([[1, 2]]), bad_word_owner=torch.tensor([0]),
             history=torch.tensor([[-1, 3]]))
    got = backend.process_logits(*({k: v.to(backend.device_type) if isinstance(v, torch.Tensor) else v
                                    for k, v in a.items()}).values()).cpu()
    assert got[0, 2] == 0 and got[1, 2] == -math.inf and got[2, 2] == 0
    _check(backend, a)


def test_min_tokens_masks_stops_until_the_row_allows_them(backend):
    """Two tokens still to come before a stop: the root row and the row after one draft mask it."""
    a = _one([4, 4, 4], 3, stop_ids=torch.tensor([[7, -1]]), min_tokens=torch.tensor([2]))
    got = backend.process_logits(*({k: v.to(backend.device_type) if isinstance(v, torch.Tensor) else v
                                    for k, v in a.items()}).values()).cpu()
    assert got[:, 7].tolist() == [-math.inf, -math.inf, 0.0, 0.0]
    _check(backend, a)


def test_min_p_keeps_what_reaches_min_p_of_the_top(backend):
    """Logits log([1, 0.5, 0.2, 0.05]) at T = 1 with min_p 0.3 keep the first two only; greedy rows keep all."""
    logits = torch.log(torch.tensor([[1.0, 0.5, 0.2, 0.05]] * 2))
    a = dict(_one([], 0, V=4), logits=logits, cu_num_draft_tokens=torch.tensor([0, 0, 0]),
             min_p=torch.tensor([[0.3, 1.0], [0.3, 0.0]]))
    got = backend.process_logits(*({k: v.to(backend.device_type) if isinstance(v, torch.Tensor) else v
                                    for k, v in a.items()}).values()).cpu()
    assert torch.isinf(got[0]).tolist() == [False, False, True, True]
    assert not torch.isinf(got[1]).any()
    _check(backend, a)
