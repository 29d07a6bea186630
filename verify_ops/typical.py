from __future__ import annotations

import torch
from torch import Tensor

from verify_ops._common import TYPICAL_BONUS, categorical, emit, ragged_layout, take, uniform


def verify_typical(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_probs: Tensor,
                   seeds: Tensor, offsets: Tensor, max_k: int, posterior_threshold: float,
                   posterior_alpha: float) -> tuple[Tensor, Tensor]:
    # LOSSY (Medusa): accept x_j iff p_j(x_j) > min(eps, delta * exp(-H(p_j))).
    # First rejection: argmax p_j; all accepted: bonus sampled from p_k.
    k, valid, draft_idx, rows = ragged_layout(cu_num_draft_tokens, max_k)
    x = take(draft_token_ids.long(), draft_idx)
    p_all = target_probs.float()
    entropy = -torch.special.xlogy(p_all, p_all).sum(-1)                  # nats, fp32
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold),
                              posterior_alpha * torch.exp(-entropy))
    p_x = p_all[rows[:, :max_k], x]
    n_acc = ((p_x > threshold[rows[:, :max_k]]) & valid).int().cumprod(-1).sum(-1)

    p = target_probs[rows.gather(1, n_acc[:, None].long())[:, 0]]
    u = uniform(seeds, offsets, TYPICAL_BONUS, torch.zeros(1, dtype=torch.long, device=x.device))[:, 0]
    last = torch.where(n_acc < k, p.float().argmax(-1), categorical(p, u))
    return emit(x, n_acc, last, max_k), n_acc.int()
