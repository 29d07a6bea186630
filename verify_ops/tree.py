from __future__ import annotations

import torch
from torch import Tensor

from verify_ops._common import TREE_ACCEPT, TREE_FINAL, categorical, take, uniform


def verify_tree(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor,
                target: Tensor, draft_probs: Tensor | None, seeds: Tensor | None,
                offsets: Tensor | None, max_k: int) -> tuple[Tensor, Tensor, Tensor]:
    # One sweep over node indices (parents precede children), vectorised over requests.
    # Node i is tried iff its parent is the current node. Greedy: accept iff x == argmax.
    # Sampling: accept iff u*q(x) < r(x); on rejection r = norm(max(r - q, 0)) (p if zero).
    cu = cu_num_draft_tokens.long()
    R, dev = cu.shape[0] - 1, cu.device
    k, ar = cu[1:] - cu[:-1], torch.arange(R, device=dev)
    greedy = seeds is None
    tokens = torch.full((R, max_k + 1), -1, dtype=torch.long, device=dev)
    nodes = torch.full((R, max_k), -1, dtype=torch.long, device=dev)
    depth = torch.zeros(R, dtype=torch.long, device=dev)
    cur = torch.full((R,), -1, dtype=torch.long, device=dev)  # -1: the root
    row = cu[:-1] + ar                                        # target row of the current node
    residual = None if greedy else target[row].float()
    for i in range(max_k):
        flat = torch.minimum(cu[:-1] + i, (cu[1:] - 1).clamp(min=0))
        x = take(draft_token_ids.long(), flat)
        tried = (i < k) & (take(parent_ids.long(), flat) == cur)
        if greedy:
            acc = tried & (x == target[row].float().argmax(-1))
        else:
            q = take(draft_probs, flat).float() if draft_probs is not None else \
                torch.zeros_like(residual).scatter_(1, x[:, None], 1.0)
            u = uniform(seeds, offsets, TREE_ACCEPT, torch.full((1,), i, device=dev))[:, 0]
            acc = tried & (u * q.gather(1, x[:, None])[:, 0].double()
                           < residual.gather(1, x[:, None])[:, 0].double())
            rest = (residual - q).clamp(min=0)
            total = rest.sum(-1, keepdim=True)
            rest = torch.where(total > 0, rest / total.clamp(min=1e-30), target[row].float())
            residual = torch.where((tried & ~acc)[:, None], rest, residual)
        tokens[ar, depth] = torch.where(acc, x, tokens[ar, depth])
        nodes[ar, depth.clamp(max=max(max_k - 1, 0))] = torch.where(
            acc, i, nodes[ar, depth.clamp(max=max(max_k - 1, 0))])
        depth, cur = depth + acc.long(), torch.where(acc, i, cur)
        row = torch.where(acc, cu[:-1] + ar + 1 + i, row)
        if not greedy:
            residual = torch.where(acc[:, None], target[row].float(), residual)
    if greedy:
        last = target[row].float().argmax(-1)
    else:
        last = categorical(residual, uniform(seeds, offsets, TREE_FINAL, torch.zeros(1, dtype=torch.long,
                                                                                      device=dev))[:, 0])
    tokens[ar, depth] = last
    return tokens.int(), nodes.int(), depth.int()
