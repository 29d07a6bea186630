from __future__ import annotations

import torch
from torch import Tensor

from hal.ops import SAMPLING_EPS
from verify_ops._common import ACCEPT, emit, ragged_layout, take, uniform
from verify_ops.rejection import recover


def verify_rejection_logits(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
                            target_logits: Tensor, temperature: Tensor, seeds: Tensor, offsets: Tensor,
                            max_k: int) -> tuple[Tensor, Tensor]:
    # One pass per row for its max and argmax, one for e = exp((logits - max) / T) and its sum s:
    # p(x) = e[x] / s at the drafts. A greedy request (T < SAMPLING_EPS) accepts while x == argmax.
    # Only each request's last row (first rejection or bonus) becomes a full p = e / s, and its
    # last token comes from verify_rejection's `recover` (residual at a rejection, p at the bonus).
    k, valid, draft_idx, rows = ragged_layout(cu_num_draft_tokens, max_k)
    greedy = temperature < SAMPLING_EPS
    t_row = torch.where(greedy, 1.0, temperature).repeat_interleave(k + 1, output_size=target_logits.shape[0])
    logits = target_logits.float()
    top = logits.argmax(-1)                                                     # [N + R]
    m = logits.gather(1, top[:, None])
    e = (logits - torch.where(m > -torch.inf, m, 0.0)).div_(t_row[:, None]).exp_()
    s = e.sum(-1).clamp(min=1.0)    # >= 1 with a finite logit (the max term is 1); an all -inf row gives e = 0

    x = take(draft_token_ids.long(), draft_idx)
    at = rows[:, :max_k]
    p_x = (e[at, x] / s[at]).double()
    q_x = draft_probs[draft_idx, x].double() if draft_probs is not None and x.numel() and \
        draft_probs.shape[0] else torch.ones_like(p_x)
    u = uniform(seeds, offsets, ACCEPT, torch.arange(max_k, device=x.device))
    n_acc = (torch.where(greedy[:, None], x == top[at], u * q_x < p_x) & valid).int().cumprod(-1).sum(-1)

    last = rows.gather(1, n_acc[:, None].long())[:, 0]
    sampled = recover(e[last] / s[last, None], x, n_acc, k, draft_idx, draft_probs, seeds, offsets, max_k)
    return emit(x, n_acc, torch.where(greedy, top[last], sampled), max_k), n_acc.int()
