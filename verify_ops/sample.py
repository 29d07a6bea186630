from __future__ import annotations

import torch
from torch import Tensor

from verify_ops._common import SAMPLE, categorical, uniform


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
           offsets: Tensor) -> tuple[Tensor, Tensor]:
    # q = softmax(top_p(top_k(logits / T))); T == 0 rows: q = one_hot(argmax).
    # top-k keeps ranks < k (stable sort: lower ids first on ties); top-p keeps a token
    # while the mass strictly before it (after top-k, renormalised) is < top_p.
    R, V = logits.shape
    greedy = temperature == 0
    z = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    k = top_k.long()
    use_k, use_p = (k >= 1) & (k < V), top_p < 1
    if bool((use_k | use_p).any()):
        z_sorted, order = z.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(V, device=z.device)[None]
        z_sorted = z_sorted.masked_fill(use_k[:, None] & (rank >= k[:, None]), -torch.inf)
        p_sorted = z_sorted.softmax(-1)
        mass_before = p_sorted.cumsum(-1) - p_sorted
        z_sorted = z_sorted.masked_fill(use_p[:, None] & (mass_before >= top_p[:, None]) & (rank > 0), -torch.inf)
        z = torch.empty_like(z).scatter_(1, order, z_sorted)
    q = z.softmax(-1)
    top = logits.argmax(-1)
    q = torch.where(greedy[:, None], torch.zeros_like(q).scatter_(1, top[:, None], 1.0), q)
    u = uniform(seeds, offsets, SAMPLE, torch.zeros(1, dtype=torch.long, device=z.device))[:, 0]
    return torch.where(greedy, top, categorical(q, u)).int(), q
