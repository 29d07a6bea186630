"""verify_tree: greedy walks, chain equivalence and exact multi-draft sampling."""

import pytest
import torch

from hal.conformance._helpers import (assert_distribution, host, put, random_probs, ragged, seeds_offsets)

pytestmark = pytest.mark.hal_op("verify_tree")


def greedy_spec(tokens, parents, logits):
    """The greedy walk by definition; logits rows: root, then one per node."""
    cur, path = -1, []
    while True:
        best = int(logits[cur + 1].argmax())
        child = next((i for i, (t, par) in enumerate(zip(tokens, parents)) if par == cur and t == best), None)
        if child is None:
            return path, best
        path.append(child)
        cur = child


def random_tree(g, n, V):
    parents = [-1] + [int(torch.randint(-1, i, (), generator=g)) for i in range(1, n)]
    tokens = [int(t) for t in torch.randint(0, V, (n,), generator=g)]
    return tokens, parents


def test_greedy_matches_definition(backend):
    g = torch.Generator().manual_seed(41)
    V, trees = 3, []
    for n in [0, 1, 4, 7, 7, 3, 6]:
        trees.append(random_tree(g, n, V) if n else ([], []))
    ids, cu = ragged([t for t, _ in trees])
    parents = torch.tensor([p for _, ps in trees for p in ps], dtype=torch.long)
    logits = torch.randn(int(cu[-1]) + len(trees), V, generator=g)
    out, nodes, n = host(*backend.verify_tree(*put(backend, ids, cu, parents, logits), None, None, None, 7))
    row = 0
    for r, (tokens, ps) in enumerate(trees):
        path, extra = greedy_spec(tokens, ps, logits[row: row + len(tokens) + 1])
        assert int(n[r]) == len(path)
        assert nodes[r].tolist() == path + [-1] * (7 - len(path))
        assert out[r].tolist() == [tokens[i] for i in path] + [extra] + [-1] * (7 - len(path))
        row += len(tokens) + 1


def test_chain_tree_equals_verify_greedy(backend, oracle):
    g = torch.Generator().manual_seed(42)
    drafts = [[int(t) for t in torch.randint(0, 4, (k,), generator=g)] for k in [3, 0, 5, 2]]
    ids, cu = ragged(drafts)
    parents = torch.tensor([j - 1 for d in drafts for j in range(len(d))], dtype=torch.long)
    logits = torch.randint(0, 4, (int(cu[-1]) + 4, 4), generator=g).float()
    out, _, n = host(*backend.verify_tree(*put(backend, ids, cu, parents, logits), None, None, None, 5))
    want = oracle.verify_greedy(ids, cu, logits, 5)
    assert torch.equal(out, want[0]) and torch.equal(n, want[1])


R = 100_000


def _tree_batch(g, V, iid: bool):
    """Root with two siblings, each with one child. Rows by depth: p0 (root), p1
    (after either sibling), p2 (after either grandchild)."""
    p = random_probs(g, 3, V)
    q = random_probs(g, 2, V)
    parents = torch.tensor([-1, -1, 0, 1]).repeat(R)
    if iid:   # siblings i.i.d. from q0, grandchildren from q1
        s = torch.multinomial(q[0].double(), 2 * R, replacement=True, generator=g).view(R, 2)
        c = torch.multinomial(q[1].double(), 2 * R, replacement=True, generator=g).view(R, 2)
        draft_probs = torch.stack([q[0], q[0], q[1], q[1]]).repeat(R, 1)
    else:     # deterministic, distinct siblings: the two most likely tokens of p0
        top = p[0].argsort(descending=True)[:2]
        s = top.repeat(R, 1)
        c = torch.stack([p[1].argmax(), p[1].argsort(descending=True)[1]]).repeat(R, 1)
        draft_probs = None
    tokens = torch.stack([s[:, 0], s[:, 1], c[:, 0], c[:, 1]], 1).reshape(-1)
    target = torch.stack([p[0], p[1], p[1], p[2], p[2]]).repeat(R, 1)
    cu = torch.arange(R + 1) * 4
    return p, tokens, cu, parents, target, draft_probs


@pytest.mark.parametrize("iid", [True, False], ids=["iid-siblings", "deterministic-siblings"])
def test_sampling_is_exact(backend, iid):
    g = torch.Generator().manual_seed(43 + iid)
    p, tokens, cu, parents, target, dprobs = _tree_batch(g, 5, iid)
    seeds, offsets = seeds_offsets(R, base=17)
    out, nodes, n = host(*backend.verify_tree(*put(backend, tokens, cu, parents, target, dprobs, seeds,
                                                    offsets), 4))
    assert bool((n <= 2).all()) and bool(((out >= 0).sum(1) == n + 1).all())
    for j in range(3):
        reached = n >= j
        assert int(reached.sum()) >= 1000, "test design: too few samples"
        assert_distribution(out[reached, j], p[j], f"tree ({'iid' if iid else 'det'}): depth {j}")
    # the path follows parent links
    pr = parents.view(R, 4)
    first, second = nodes[:, 0].long(), nodes[:, 1].long()
    ok1 = (n < 1) | ((first >= 0) & (pr.gather(1, first.clamp(min=0)[:, None])[:, 0] == -1))
    ok2 = (n < 2) | (pr.gather(1, second.clamp(min=0)[:, None])[:, 0] == first)
    assert bool(ok1.all()) and bool(ok2.all())
