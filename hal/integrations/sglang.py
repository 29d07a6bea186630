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


def verify_tree_sglang(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                       retrive_next_sibling: Tensor, target: Tensor, draft_probs: Tensor | None = None,
                       seeds: Tensor | None = None, offsets: Tensor | None = None, greedy: bool = False,
                       backend=None) -> tuple[Tensor, Tensor, Tensor]:
    """SGLang's ``(predicts [bs*n], accept_index [bs, n], accept_token_num [bs])`` from
    ``target [bs, n, V]`` (probabilities, or logits with ``greedy``): exact recursive rejection
    sampling (greedy: the argmax walk) by the backend's `verify_tree`."""
    be = backend or hal.get_backend()
    bs, n = candidates.shape
    V = target.shape[-1]
    if tuple(target.shape[:2]) != (bs, n):
        raise arg_error("target", f"[{bs}, {n}, V]", list(target.shape))
    parents = sglang_to_parents(retrive_next_token, retrive_next_sibling)
    d = be.device_type
    ids = candidates[:, 1:].reshape(-1).long().to(d)
    cu = (torch.arange(bs + 1) * (n - 1)).to(d)
    rows = target.reshape(bs * n, V).to(d)
    q = None if draft_probs is None else draft_probs[:, 1:].reshape(-1, V).to(d)
    if greedy:
        tok, nodes, nacc = be.verify_tree(ids, cu, parents.reshape(-1).to(d), rows, None, None, None, n - 1)
    else:
        seeds = torch.randint(-(1 << 62), 1 << 62, (bs,)) if seeds is None else seeds
        offsets = torch.zeros(bs, dtype=torch.long) if offsets is None else offsets
        tok, nodes, nacc = be.verify_tree(ids, cu, parents.reshape(-1).to(d), rows, q, seeds.to(d), offsets.to(d),
                                          n - 1)
    tok, nodes, nacc = tok.cpu(), nodes.cpu(), nacc.cpu()
    ridx = retrive_index.long().cpu()
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    for b in range(bs):
        path = [0] + [int(x) + 1 for x in nodes[b, :int(nacc[b])]]
        for j, node in enumerate(path):
            accept_index[b, j] = ridx[b, node]
            predicts[ridx[b, node]] = tok[b, j]
    return predicts, accept_index, nacc.int()
