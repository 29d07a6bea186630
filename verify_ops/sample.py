from __future__ import annotations

import torch
from torch import Tensor

from hal.ops import SAMPLING_EPS
from verify_ops._common import SAMPLE, categorical, uniform


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
           offsets: Tensor) -> tuple[Tensor, Tensor]:
    q, top = probs(logits, temperature, top_k, top_p)
    greedy = temperature < SAMPLING_EPS
    u = uniform(seeds, offsets, SAMPLE, torch.zeros(1, dtype=torch.long, device=q.device))[:, 0]
    return torch.where(greedy, top, categorical(q, u)).int(), q


def probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
          sort: int | None = None) -> tuple[Tensor, Tensor]:
    """``(q [R, V] float32, argmax [R])``: the distribution `sample` draws from, without a draw
    (vLLM's ``compute_probs``); plain torch, on any device.

    q = softmax(`filtered` z); T < SAMPLING_EPS rows: one_hot(argmax). ``sort``: see `filtered`."""
    greedy = temperature < SAMPLING_EPS
    q = filtered(logits, temperature, top_k, top_p, sort).softmax(-1)
    top = logits.float().argmax(-1)
    return torch.where(greedy[:, None], torch.zeros_like(q).scatter_(1, top[:, None], 1.0), q), top


def filtered(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, sort: int | None = None) -> Tensor:
    """z = (logits - max) / T (T = 1 on greedy rows; never overflows), float32, set to -inf
    below a per-row cutoff. top-k cutoff: the k-th largest z. top-p cutoff: in descending order
    over the top-k set, the last z whose preceding (renormalised) mass is < top_p. Ties at a
    cutoff are kept.

    ``sort``: how many of each row's largest z the filters need (`sort_width`), when the
    caller knows it on the host; None reads it from ``top_k``/``top_p`` (a host sync)."""
    R, V = logits.shape
    greedy = temperature < SAMPLING_EPS
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    z = (x - torch.where(m > -torch.inf, m, 0.0)) / torch.where(greedy, 1.0, temperature)[:, None]
    k = top_k.long()
    use_k, use_p = (k >= 1) & (k < V), top_p < 1
    if sort is None:
        sort = V if bool((use_p & ~use_k).any()) else int(k[use_k].max()) if bool(use_k.any()) else 0
    if sort:
        K = sort   # sort only what is needed
        vals = z.topk(K, dim=-1).values
        cut = torch.where(use_k[:, None], vals.gather(1, (k.clamp(1, K) - 1)[:, None]), -torch.inf)
        vals = vals.masked_fill(vals < cut, -torch.inf)
        pv = vals.softmax(-1)
        keep = (pv.cumsum(-1) - pv < top_p[:, None]) | (torch.arange(K, device=z.device) == 0)
        p_cut = vals.masked_fill(~keep, torch.inf).amin(-1, keepdim=True)
        cut = torch.where(use_p[:, None], torch.maximum(cut, p_cut), cut)
        z = z.masked_fill(z < cut, -torch.inf)
    return z


def sort_width(top_k: list[int], top_p: list[float], V: int) -> int:
    """`probs`'s ``sort`` from host values: V if a row uses top-p alone, else the largest top-k in use, else 0."""
    use_k = [1 <= k < V for k in top_k]
    if any(p < 1 and not uk for p, uk in zip(top_p, use_k)):
        return V
    return max((k for k, uk in zip(top_k, use_k) if uk), default=0)
