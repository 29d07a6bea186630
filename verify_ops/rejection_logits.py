from __future__ import annotations

import torch
from torch import Tensor

from hal.ops import SAMPLING_EPS
from verify_ops._common import ACCEPT, emit, ragged_layout, take, uniform
from verify_ops.rejection import recover

CHUNK_BYTES = 1 << 21
"""Rows are processed in chunks of about this many bytes, so that a row's max, shift, exp and
sum all run while it is in cache: the logits are read from memory once, not once per step."""


def verify_rejection_logits(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
                            target_logits: Tensor, temperature: Tensor, seeds: Tensor, offsets: Tensor,
                            max_k: int) -> tuple[Tensor, Tensor]:
    return from_logits(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature, seeds, offsets,
                       max_k, CHUNK_BYTES)


def from_logits(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
                target_logits: Tensor, temperature: Tensor, seeds: Tensor, offsets: Tensor, max_k: int,
                chunk_bytes: int | None) -> tuple[Tensor, Tensor]:
    """The op, reading the logits ``chunk_bytes`` at a time (None: all rows at once, fewer kernels on a device).

    Per row: its max m, p(x) = exp(z_x) / sum(exp(z)) with z = (logits - m) / T at its draft x,
    and whether x is its argmax (x holds m and no lower id does). A greedy request (T <
    SAMPLING_EPS) accepts while x is the argmax; a sampled one iff u * q(x) < p(x). Only each
    request's last row (first rejection or bonus) becomes a full p, and its last token comes from
    verify_rejection's `recover` (the residual at a rejection, p at the bonus row), or is the
    argmax for a greedy request."""
    k, valid, draft_idx, rows = ragged_layout(cu_num_draft_tokens, max_k)
    NR, V = target_logits.shape
    N, R = draft_token_ids.shape[0], k.shape[0]
    dev = target_logits.device
    greedy = temperature < SAMPLING_EPS
    t_row = torch.where(greedy, 1.0, temperature).repeat_interleave(k + 1, output_size=NR)
    tok = torch.zeros(NR, dtype=torch.long, device=dev)                     # each row's draft (0 at bonus rows)
    tok[torch.arange(N, device=dev) + torch.arange(R, device=dev).repeat_interleave(k, output_size=N)] = \
        draft_token_ids.long()
    p_tok = torch.empty(NR, dtype=torch.float64, device=dev)
    is_top = torch.empty(NR, dtype=torch.bool, device=dev)
    chunks = list(_chunks(NR, V, chunk_bytes))
    work = torch.empty(max((b - a for a, b in chunks), default=0), V, device=dev)   # reused: stays in cache
    for a, b in chunks:
        x = target_logits[a:b].float()
        t = tok[a:b, None]
        m, earlier = _max_and_max_below(x, t)
        is_top[a:b] = ((x.gather(1, t) == m) & ((t == 0) | (earlier < m)))[:, 0]
        z = torch.sub(x, torch.where(m > -torch.inf, m, 0.0), out=work[:b - a]).div_(t_row[a:b, None])
        p_tok[a:b] = torch.log_softmax(z, -1).gather(1, t)[:, 0].double().exp()

    x = take(draft_token_ids.long(), draft_idx)
    at = rows[:, :max_k]
    q_x = draft_probs[draft_idx, x].double() if draft_probs is not None and x.numel() and \
        draft_probs.shape[0] else torch.ones_like(p_tok[at])
    u = uniform(seeds, offsets, ACCEPT, torch.arange(max_k, device=x.device))
    n_acc = (torch.where(greedy[:, None], is_top[at], u * q_x < p_tok[at]) & valid).int().cumprod(-1).sum(-1)

    last = rows.gather(1, n_acc[:, None].long())[:, 0]
    token = torch.empty(R, dtype=torch.long, device=dev)
    for a, b in _chunks(R, V, chunk_bytes):
        xl = target_logits[last[a:b]].float()
        top = xl.argmax(-1)
        ml = xl.gather(1, top[:, None])
        p = ((xl - torch.where(ml > -torch.inf, ml, 0.0)).div_(t_row[last[a:b], None])).softmax(-1).nan_to_num_(0.0)
        drawn = recover(p, x[a:b], n_acc[a:b], k[a:b], draft_idx[a:b], draft_probs, seeds[a:b], offsets[a:b], max_k)
        token[a:b] = torch.where(greedy[a:b], top, drawn)
    return emit(x, n_acc, token, max_k), n_acc.int()


def _chunks(rows: int, V: int, chunk_bytes: int | None):
    step = rows if chunk_bytes is None else max(1, chunk_bytes // (4 * max(V, 1)))
    return ((a, min(a + step, rows)) for a in range(0, rows, max(step, 1)))


def _max_and_max_below(x: Tensor, t: Tensor, block: int = 256) -> tuple[Tensor, Tensor]:
    """``(max of each row, max of its entries at ids < t)``, both ``[C, 1]``, from one pass of
    block maxima: whole blocks below t's block, then t's own block up to t (-inf when empty)."""
    C, V = x.shape
    nb, tail = V // block, V % block
    bm = x[:, :nb * block].reshape(C, nb, block).amax(-1)                      # [C, nb]
    if tail:
        bm = torch.cat([bm, x[:, nb * block:].amax(-1, keepdim=True)], 1)
    m = bm.amax(-1, keepdim=True)
    tb = t // block
    before = torch.where(torch.arange(bm.shape[1], device=x.device) < tb, bm, -torch.inf).amax(-1, keepdim=True)
    own = x.gather(1, (tb * block + torch.arange(block, device=x.device)).clamp(max=V - 1))  # t's block (clamped)
    own = torch.where(tb * block + torch.arange(block, device=x.device) < t, own, -torch.inf).amax(-1, keepdim=True)
    return m, torch.maximum(before, own)
