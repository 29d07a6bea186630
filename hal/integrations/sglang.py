"""SGLang's tree layout on spec-hal's `verify_tree`.

SGLang (``sgl-kernel``'s ``tree_speculative_sampling_target_only`` and its EAGLE worker)
describes each request's draft tree over ``n`` nodes, node 0 the root (the last verified
token): ``candidates [bs, n]`` the node tokens, ``retrive_index [bs, n]`` each node's flat
row, ``retrive_next_token [bs, n]`` its first child and ``retrive_next_sibling [bs, n]`` its
next sibling (-1: none). spec-hal uses parent indices over the non-root nodes
(``parent_ids``, -1 for a child of the root). Conversions go both ways; `verify_tree_sglang`
returns SGLang's outputs (``predicts``, ``accept_index``, ``accept_token_num``). SGLang is not
imported.
"""

from __future__ import annotations

import torch
from torch import Tensor

import hal
from hal.errors import arg_error


def sglang_to_parents(next_token: Tensor, next_sibling: Tensor) -> Tensor:
    """``[bs, n-1]`` local parent ids (node ``i`` of ours is SGLang's node ``i + 1``; -1: the
    root). SGLang builds its trees parent-first; a tree that is not is refused."""
    nt, ns = next_token.long().cpu(), next_sibling.long().cpu()
    bs, n = nt.shape
    parent = torch.full((bs, n), -2, dtype=torch.long)
    for b in range(bs):
        parent[b, 0] = -1
        stack = [0]
        while stack:
            p = stack.pop()
            c = int(nt[b, p])
            while c != -1:
                if not 0 < c < n or parent[b, c] != -2:
                    raise arg_error("retrive_next_token", f"a tree over nodes 1..{n - 1} (each reached once)",
                                    f"node {c} under {p} in request {b}")
                if c <= p:
                    raise arg_error("retrive_next_token", "parents before children (SGLang's order)",
                                    f"child {c} of node {p} in request {b}")
                parent[b, c] = p
                stack.append(c)
                c = int(ns[b, c])
    return torch.where(parent[:, 1:] > 0, parent[:, 1:] - 1, -1).clamp(min=-1)


def parents_to_sglang(parent_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(retrive_next_token, retrive_next_sibling)`` ``[bs, n]`` (with the root) from local
    parent ids ``[bs, n-1]``; children listed in index order."""
    par = parent_ids.long().cpu()
    bs, m = par.shape
    nt = torch.full((bs, m + 1), -1, dtype=torch.long)
    ns = torch.full((bs, m + 1), -1, dtype=torch.long)
    for b in range(bs):
        last: dict[int, int] = {}
        for i in range(m):
            node, p = i + 1, int(par[b, i]) + 1          # SGLang numbering: root 0
            if p in last:
                ns[b, last[p]] = node
            else:
                nt[b, p] = node
            last[p] = node
    return nt, ns


def list_order(next_token: Tensor, next_sibling: Tensor, max_depth: int | None = None) -> list[list[tuple[int, int]]]:
    """Per request, the non-root nodes as ``(SGLang node, local parent)`` in SGLang's walk
    order: depth first, each node's children in its ``retrive_next_token`` /
    ``retrive_next_sibling`` list order (so `verify_tree`, which tries children in index
    order, tries them in SGLang's order; parents come before children), without nodes deeper
    than ``max_depth``. A list that is not a tree is refused."""
    sglang_to_parents(next_token, next_sibling)   # validates: every node reached once, parent first
    nt, ns = next_token.long().tolist(), next_sibling.long().tolist()
    out = []
    for b in range(len(nt)):
        order, local, parent = [], {0: -1}, {}
        for p in range(len(nt[b])):
            c = nt[b][p]
            while c != -1:
                parent[c], c = p, ns[b][c]
        stack = [(0, 0)]
        while stack:   # iterative pre-order: a child's subtree before its next sibling
            node, depth = stack.pop()
            if node:
                order.append((node, local[parent[node]]))
                local[node] = len(order) - 1
            kids, c = [], nt[b][node]
            while c != -1:
                kids.append(c)
                c = ns[b][c]
            if max_depth is None or depth + 1 <= max_depth:
                stack += [(c, depth + 1) for c in reversed(kids)]
        out.append(order)
    return out


def verify_tree_sglang(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                       retrive_next_sibling: Tensor, target: Tensor, draft_probs: Tensor | None = None,
                       seeds: Tensor | None = None, offsets: Tensor | None = None, greedy: bool = False,
                       backend=None, num_spec_step: int | None = None, threshold_single: float = 1.0,
                       threshold_acc: float = 1.0, uniform_samples: Tensor | None = None,
                       uniform_samples_for_final_sampling: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """SGLang's ``(predicts [bs*n], accept_index [bs, num_spec_step], accept_token_num [bs])``
    from ``target [bs, n, V]`` (probabilities, or logits with ``greedy``).

    Children are tried in SGLang's list order; at most ``num_spec_step - 1`` tokens are
    accepted (default ``n``: the tree's depth bounds it). With both thresholds at 1 (the
    default) it is exact recursive rejection sampling (greedy: the argmax walk) by the
    backend's `verify_tree`. Below 1 it is SGLang's relaxed acceptance, **LOSSY** like
    `hal.ops.Ops.verify_typical` (the output is not distributed as the target): a child is
    accepted iff ``coin <= prob_acc / threshold_acc`` (``prob_acc`` the target mass of the
    siblings tried so far, this one included) or ``p(x) >= threshold_single``; the last
    token is drawn from the target with the rejected siblings' mass removed (from the
    target alone after ``num_spec_step - 1`` acceptances). Coins: ``uniform_samples [bs, n]``
    and ``uniform_samples_for_final_sampling [bs]`` as SGLang's, else drawn from ``seeds``."""
    be = backend or hal.get_backend()
    bs, n = candidates.shape
    if tuple(target.shape[:2]) != (bs, n):
        raise arg_error("target", f"[{bs}, {n}, V]", list(target.shape))
    steps = n if num_spec_step is None else int(num_spec_step)
    if steps < 1:
        raise arg_error("num_spec_step", "an int >= 1", num_spec_step)
    for name, v in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not 0 <= v <= 1:
            raise arg_error(name, "a float in [0, 1]", v)
    orders = list_order(retrive_next_token, retrive_next_sibling, steps - 1)
    lossy = not greedy and (threshold_single < 1 or threshold_acc < 1)
    if lossy:
        paths, last = _relaxed(orders, candidates, target, retrive_next_token, retrive_next_sibling, steps,
                               threshold_single, threshold_acc, seeds, uniform_samples,
                               uniform_samples_for_final_sampling)
    else:
        paths, last = _exact(be, orders, candidates, target, draft_probs, seeds, offsets, greedy)
    ridx = retrive_index.long().cpu()
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
    for b in range(bs):
        path = [0] + paths[b]
        for j, node in enumerate(path):
            accept_index[b, j] = ridx[b, node]
        tokens = [int(candidates[b, node]) for node in path[1:]] + [last[b]]
        for node, tok in zip(path, tokens):
            predicts[ridx[b, node]] = tok
    return predicts, accept_index, torch.tensor([len(p) for p in paths], dtype=torch.int32)


def _exact(be, orders, candidates, target, draft_probs, seeds, offsets, greedy):
    """Each request's accepted SGLang nodes and its last token, by `verify_tree`."""
    bs, n = candidates.shape
    V = target.shape[-1]
    d = be.device_type
    counts = [len(o) for o in orders]
    nodes = [c for o in orders for c, _ in o]
    owner = [b for b, o in enumerate(orders) for _ in o]
    ids = candidates.long().cpu()[owner, nodes] if nodes else torch.zeros(0, dtype=torch.long)
    parents = torch.tensor([p for o in orders for _, p in o], dtype=torch.long)
    cu = torch.tensor([0, *counts]).cumsum(0)
    row_nodes = [(b, c) for b, o in enumerate(orders) for c in [0] + [x for x, _ in o]]
    flat = target.reshape(bs, n, V).cpu()
    rows = torch.stack([flat[b, c] for b, c in row_nodes]) if row_nodes else flat.reshape(0, V)
    q = None
    if draft_probs is not None and nodes:
        q = draft_probs.reshape(bs, n, V).cpu()[owner, nodes].to(d)
    max_k = max(counts, default=0)
    if greedy:
        tok, acc_nodes, nacc = be.verify_tree(ids.to(d), cu.to(d), parents.to(d), rows.to(d), None, None, None, max_k)
    else:
        seeds = torch.randint(-(1 << 62), 1 << 62, (bs,)) if seeds is None else seeds
        offsets = torch.zeros(bs, dtype=torch.long) if offsets is None else offsets
        tok, acc_nodes, nacc = be.verify_tree(ids.to(d), cu.to(d), parents.to(d), rows.to(d), q, seeds.to(d),
                                              offsets.to(d), max_k)
    tok, acc_nodes, nacc = tok.cpu(), acc_nodes.cpu(), nacc.cpu()
    paths = [[orders[b][int(x)][0] for x in acc_nodes[b, :int(nacc[b])]] for b in range(bs)]
    return paths, [int(tok[b, int(nacc[b])]) for b in range(bs)]


def _relaxed(orders, candidates, target, next_token, next_sibling, steps, th_single, th_acc, seeds, coins,
             final_coins):
    """SGLang's thresholded walk (LOSSY; see `verify_tree_sglang`), per request on the host."""
    bs, n = candidates.shape
    probs = target.reshape(bs, n, -1).double().cpu()
    nt, ns = next_token.long().tolist(), next_sibling.long().tolist()
    if coins is None or final_coins is None:
        seeds = torch.randint(-(1 << 62), 1 << 62, (bs,)) if seeds is None else seeds
        gens = [torch.Generator().manual_seed(int(s) % (1 << 63)) for s in seeds.tolist()]
        coins = torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in gens])
        final_coins = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
    coins, final_coins = coins.double().cpu(), final_coins.double().cpu()
    kept = [{c for c, _ in o} for o in orders]
    th_acc = max(th_acc, 1e-9)   # as SGLang caps it
    paths, last = [], []
    for b in range(bs):
        cur, acc, coin, path = 0, 0.0, float(coins[b, 0]), []
        removed = torch.zeros(probs.shape[-1], dtype=torch.float64)
        for _ in range(1, steps):
            child = nt[b][cur]
            while child != -1:
                if child in kept[b]:
                    ps = float(probs[b, cur, int(candidates[b, child])])
                    acc += ps
                    if coin <= acc / th_acc or ps >= th_single:
                        cur, acc, coin = child, 0.0, float(coins[b, child])
                        path.append(child)
                        removed = torch.zeros_like(removed)
                        break
                    removed[int(candidates[b, child])] = ps
                child = ns[b][child]
            if child == -1:
                break
        p = probs[b, cur]
        residual = p if len(path) == steps - 1 else (p - removed).clamp(min=0)
        total = float(residual.sum())
        if total <= 0:
            residual, total = p, float(p.sum())
        cum = residual.cumsum(0)
        pick = int(torch.searchsorted(cum, torch.tensor([float(final_coins[b]) * total], dtype=torch.float64),
                                      right=True).clamp(max=probs.shape[-1] - 1))
        paths.append(path)
        last.append(pick)
    return paths, last
