from __future__ import annotations

import torch
from torch import Tensor

from hal.ops import SAMPLING_EPS


def process_logits(logits: Tensor, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor | None,
                   penalties: Tensor | None, token_counts: Tensor | None, prompt_mask: Tensor | None,
                   bias: Tensor | None, bad_words: Tensor | None, bad_word_owner: Tensor | None,
                   history: Tensor | None, stop_ids: Tensor | None, min_tokens: Tensor | None,
                   min_p: Tensor | None, max_k: int) -> Tensor:
    """`hal.ops.Ops.process_logits` in torch ops, vectorised over the rows (no host sync).

    Each row's *path* (the drafts before it, newest first) comes from one gather per depth;
    every processor that depends on the path (penalty counts, bad-word prefixes, the
    min_tokens position) reads it, so a row sees the drafts before it as generated output."""
    NR, V = logits.shape
    R = cu_num_draft_tokens.shape[0] - 1
    N = draft_token_ids.shape[0]
    dev = logits.device
    cu = cu_num_draft_tokens.long()
    k = cu[1:] - cu[:-1]
    req = torch.arange(R, device=dev).repeat_interleave(k + 1, output_size=NR)      # [NR] each row's request
    local = torch.arange(NR, device=dev) - (cu[:-1] + torch.arange(R, device=dev))[req]   # 0: the root row
    path = _paths(draft_token_ids.long(), cu, parent_ids, req, local, max_k, N)     # [NR, max_k] newest first, -1
    plen = (path >= 0).sum(-1)                                                      # [NR] drafts before the row
    out = logits.float() + bias.float()[req] if bias is not None else logits.float().clone()
    rows = torch.arange(NR, device=dev)[:, None]
    # (bias first: logit_bias, -inf where a request's allowed ids exclude the token)
    if bad_words is not None and bad_words.shape[0]:
        _ban_bad_words(out, path, plen, req, bad_words.long(), bad_word_owner.long(), history.long())
    if stop_ids is not None and stop_ids.shape[1]:   # min_tokens: no stop token before the row's position allows it
        stops = stop_ids.long()[req]                                                 # [NR, S]
        early = (plen < min_tokens.long()[req])[:, None] & (stops >= 0)
        out.index_put_((rows.expand_as(stops), stops.clamp(min=0)),
                       torch.where(early, -torch.inf, 0.0), accumulate=True)
    if penalties is not None:
        out = _penalise(out, penalties.float(), token_counts, prompt_mask, req, path)
    if min_p is not None:
        mp, temp = min_p.float()[req, 0, None], min_p.float()[req, 1, None]
        top = out.amax(-1, keepdim=True)
        keep = out >= top + temp * torch.log(mp.clamp(min=1e-30))
        out = torch.where((temp >= SAMPLING_EPS) & (mp > 0) & ~keep, -torch.inf, out)
    return out


def _scaled(x: Tensor, rep: Tensor) -> Tensor:
    return torch.where(x > 0, x / rep, x * rep)


def _charge(counts: Tensor, freq: Tensor, pres: Tensor) -> Tensor:
    """``freq * c + pres * (c > 0)``, float32: one expression for the dense rows and the path
    fix-ups, so a row after drafts is bit-identical to the same row in plain decoding."""
    c = counts.float()
    return freq * c + pres * (c > 0).float()


def _penalise(out: Tensor, pen: Tensor, token_counts: Tensor, prompt_mask: Tensor, req: Tensor,
              path: Tensor) -> Tensor:
    """Penalties over every row from its request's counts (computed once per request, one
    dense pass over the rows), then at the tokens on each row's path again with the path's
    occurrences added (a gather and one scatter of ``[NR, max_k]``; duplicates write
    identical values)."""
    freq, pres, rep = (pen[:, i, None] for i in range(3))                          # [R, 1] each
    charge = _charge(token_counts, freq, pres)                                      # [R, V]
    seen = prompt_mask | (token_counts > 0)
    x_path = out.gather(1, path.clamp(min=0))                                       # before penalties
    dense = torch.where(seen[req], _scaled(out, rep[req]), out).sub_(charge[req])
    if path.shape[1]:
        valid = path >= 0
        occ = ((path[:, :, None] == path[:, None, :]) & valid[:, None, :]).sum(-1)   # [NR, max_k] in the path
        counts = token_counts[req[:, None], path.clamp(min=0)].long() + occ
        val = _scaled(x_path, rep[req]) - _charge(counts, freq[req], pres[req])
        cols = torch.where(valid, path, path[:, :1]).clamp(min=0)                  # padding: a valid column
        val = torch.where(valid, val, torch.where(valid[:, :1], val[:, :1], dense.gather(1, cols)))
        dense.scatter_(1, cols, val)
    return dense


def _paths(ids: Tensor, cu: Tensor, parent_ids: Tensor | None, req: Tensor, local: Tensor, max_k: int,
           N: int) -> Tensor:
    """``[NR, max_k]``: each row's drafts before it (global draft indices' tokens), newest
    first, -1 padded. Row ``j >= 1`` of a request follows its node ``j - 1``: that node and
    its ancestors (a chain's nodes ``j - 1, ..., 0``)."""
    NR, dev = req.shape[0], ids.device
    if max_k == 0 or N == 0:
        return torch.full((NR, max_k), -1, dtype=torch.long, device=dev)
    node = torch.where(local > 0, cu[:-1][req] + local - 1, -1)                    # [NR] global node or -1
    if parent_ids is None:
        parent = torch.arange(N, device=dev) - 1                                    # a chain: the previous draft
        first = cu[:-1].repeat_interleave(cu[1:] - cu[:-1], output_size=N)
        parent = torch.where(parent >= first, parent, -1)
    else:
        owner = torch.arange(cu.shape[0] - 1, device=dev).repeat_interleave(cu[1:] - cu[:-1], output_size=N)
        parent = torch.where(parent_ids.long() >= 0, cu[:-1][owner] + parent_ids.long(), -1)
    cols = [node]
    for _ in range(max_k - 1):
        cols.append(torch.where(cols[-1] >= 0, parent[cols[-1].clamp(min=0)], -1))
    nodes = torch.stack(cols, 1)
    return torch.where(nodes >= 0, ids[nodes.clamp(min=0)], -1)


def _ban_bad_words(out: Tensor, path: Tensor, plen: Tensor, req: Tensor, words: Tensor, owner: Tensor,
                   history: Tensor) -> None:
    """-inf at a word's last token in each row of its request whose context (the history,
    then the path) ends with the word's other tokens. ``words [W, L]`` right-aligned."""
    NR, W, L = out.shape[0], words.shape[0], words.shape[1]
    H = history.shape[1]
    dev = out.device
    m = torch.arange(max(L - 1, 0), device=dev)                                      # 0: the newest context token
    from_path = path.gather(1, m.clamp(max=max(path.shape[1] - 1, 0))[None].expand(NR, -1)) if path.shape[1] \
        else torch.full((NR, m.numel()), -1, dtype=torch.long, device=dev)
    h_at = H - 1 - (m[None] - plen[:, None])                                         # history column, newest last
    from_hist = history[req[:, None], h_at.clamp(0, max(H - 1, 0))] if H else torch.full_like(from_path, -1)
    ctx = torch.where(m[None] < plen[:, None], from_path, torch.where(h_at >= 0, from_hist, -1))  # [NR, L-1]
    prefix = words[:, :L - 1].flip(-1)                                               # [W, L-1] newest first
    ok = (prefix[:, None] < 0) | (prefix[:, None] == ctx[None])                      # [W, NR, L-1]
    match = ok.all(-1) & (owner[:, None] == req[None]) & (words[:, L - 1:] >= 0)     # [W, NR]
    cols = words[:, L - 1].clamp(min=0)[:, None].expand(W, NR)
    rows = torch.arange(NR, device=dev)[None].expand(W, NR)
    out.index_put_((rows, cols), torch.where(match, -torch.inf, 0.0), accumulate=True)
