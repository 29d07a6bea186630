"""Shared by the drafters: a `Proposal` from padded drafts (`slots`, `empty`), a
sub-batch of a `DraftBatch` and back (`subset`, `widen`), fewer slots per request than
asked widened with filler (`pad`), and an autoregressive sampled chain (`sample_chain`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from hal.ops import cumulative
from hal.engine.forward import sampling_tensors
from hal.engine.drafting import DraftBatch, Proposal


def slots(drafts: Tensor, k: tuple[int, ...], probs: Tensor | None = None, num_valid=None,
          top: tuple[Tensor, Tensor] | None = None, own: Tensor | None = None) -> Proposal:
    """A `Proposal` from padded drafts ``[R, K]`` (and q ``[R, K, V]``, each slot's likeliest
    tokens and their probabilities ``[R, K, F]`` twice, and the drafter's own features ``[R, K,
    H]``): the first ``k[i]`` of row i."""
    cu = torch.tensor([0, *k], dtype=torch.long).cumsum(0).to(drafts.device)
    ids = slot_rows(drafts, k).long()
    q = None if probs is None else slot_rows(probs, k)
    top_ids, top_p = (None, None) if top is None else (slot_rows(t, k) for t in top)
    return Proposal(draft_token_ids=ids, cu_num_draft_tokens=cu, draft_probs=q, num_valid=num_valid,
                    top_ids=top_ids, top_probs=top_p, own_features=None if own is None else slot_rows(own, k))


def slot_rows(padded: Tensor, k: tuple[int, ...]) -> Tensor:
    """Rows ``[sum(k), ...]`` of a padded ``[R, K, ...]``: the first ``k[i]`` of row i."""
    R, K = padded.shape[0], padded.shape[1] if padded.dim() >= 2 else 0
    idx = torch.tensor([i * K + j for i, n in enumerate(k) for j in range(n)], dtype=torch.long).to(padded.device)
    return padded.reshape(R * K, *padded.shape[2:])[idx]


def empty(R: int, device) -> Proposal:
    return slots(torch.zeros(R, 0, dtype=torch.long, device=device), (0,) * R)


def subset(batch: DraftBatch, keep: list[int]) -> DraftBatch:
    """The rows ``keep`` of a `DraftBatch` (its features and prefix-cache names too)."""
    pick = lambda t: t[torch.tensor(keep, dtype=torch.long).to(t.device)]  # noqa: E731
    feats, counts = _pick_blocks(batch.features, batch.num_features, keep)
    own, num_own = _pick_blocks(batch.own_features, batch.num_own, keep)
    rows = lambda xs: tuple(xs[i] for i in keep)  # noqa: E731
    return DraftBatch(rids=rows(batch.rids), params=rows(batch.params), history=pick(batch.history),
                      num_tokens=pick(batch.num_tokens), lengths=None if batch.lengths is None else rows(batch.lengths),
                      k=rows(batch.k), offsets=rows(batch.offsets),
                      hidden=None if batch.hidden is None else pick(batch.hidden), features=feats, num_features=counts,
                      names=rows(batch.names) if batch.names else (), names_block_size=batch.names_block_size,
                      costs=batch.costs, alternatives=batch.alternatives, own_features=own, num_own=num_own)


def _pick_blocks(rows: Tensor | None, counts: tuple[int, ...], keep: list[int]):
    """The blocks ``keep`` of rows stored request after request (``counts[i]`` rows each)."""
    if rows is None:
        return None, tuple(counts[i] for i in keep) if counts else ()
    cu = cumulative(counts)
    return pick_rows(rows, [j for i in keep for j in range(cu[i], cu[i + 1])]), tuple(counts[i] for i in keep)


def pick_rows(t: Tensor, rows: list[int]) -> Tensor:
    return t[torch.tensor(rows, dtype=torch.long).to(t.device)]


def widen(batch: DraftBatch, keep: list[int], part: Proposal | None, dev) -> Proposal:
    """A `Proposal` for all of ``b`` from one for its rows ``keep``: the others get their
    ``k`` slots as filler (``num_valid`` 0; in a tree, children of the root); the kept rows keep
    their own ``num_valid`` (a tree's or a confidence cut's) and parents."""
    cu = cumulative(batch.k)
    at = torch.tensor([cu[i] + j for i in keep for j in range(batch.k[i])], dtype=torch.long).to(dev)
    ids = torch.zeros(cu[-1], dtype=torch.long, device=dev)
    probs = own = top = par = None
    kept = set(keep)
    valid = torch.tensor([k if i in kept else 0 for i, k in enumerate(batch.k)])
    if part is not None and part.num_valid is not None and keep:   # the kept rows' own counts (a tree's, a cut's)
        valid = valid.to(part.num_valid.device)
        valid[torch.tensor(keep, dtype=torch.long).to(valid.device)] = part.num_valid.long()
    elif part is not None and all(k == 0 for i, k in enumerate(batch.k) if i not in kept):
        valid = None   # no filler slots (the other rows asked for none): every slot is valid, nothing to read
    if part is not None and part.parent_ids is not None:   # a tree: filler slots are children of the root
        par = torch.full((cu[-1],), -1, dtype=torch.long, device=dev)
        if len(at):
            par[at] = part.parent_ids.to(dev).long()
    if part is not None and len(at):
        ids[at] = part.draft_token_ids
        if part.draft_probs is not None:
            probs = torch.zeros(cu[-1], part.draft_probs.shape[1], device=dev)
            probs[:, 0] = 1   # filler slots: valid rows, never verified
            probs[at] = part.draft_probs
        if part.own_features is not None:
            own = part.own_features.new_zeros(cu[-1], part.own_features.shape[1])
            own[at] = part.own_features
        if part.top_ids is not None:   # filler slots: token 0 at probability 0
            top = [t.new_zeros(cu[-1], t.shape[1]) for t in (part.top_ids, part.top_probs)]
            top[0][at], top[1][at] = part.top_ids, part.top_probs
    return Proposal(draft_token_ids=ids, cu_num_draft_tokens=torch.tensor(cu).to(dev), draft_probs=probs,
                    num_valid=valid, parent_ids=par,
                    top_ids=None if top is None else top[0], top_probs=None if top is None else top[1],
                    own_features=own)


def sample_chain(batch: DraftBatch, backend, dev, step: Callable[[Tensor, int], Tensor]) -> Proposal:
    """Draft max(k) tokens by ``step(x, j) -> logits`` (x: the previous draft), sampling each
    request with its own parameters at Philox offset ``offsets[i] + j``. With
    ``batch.alternatives`` = F, each slot's F likeliest tokens too: under q where the request
    samples, under softmax(logits) where it is greedy."""
    R, K, F = len(batch.rids), max(batch.k, default=0), batch.alternatives
    temp, top_k, top_p = sampling_tensors(batch.params, [1] * R, dev)
    seeds = torch.tensor([p.seed for p in batch.params], dtype=torch.long).to(dev)
    off = torch.tensor(batch.offsets, dtype=torch.long).to(dev)
    greedy = torch.tensor([p.temperature == 0 for p in batch.params]).to(dev)[:, None] if F else None
    toks, draft_probs, alt_p, alt_i, x = [], [], [], [], None
    for j in range(K):
        logits = step(x, j).float()
        tok, q = backend.sample(logits, temp, top_k, top_p, seeds, off + j)
        x = tok.long()
        toks.append(x)
        draft_probs.append(q)
        if F:
            p, i = torch.where(greedy, torch.softmax(logits, -1), q.float()).topk(min(F, logits.shape[-1]), -1)
            alt_p.append(p)
            alt_i.append(i)
    sampled = any(p.temperature > 0 for p in batch.params)
    if not toks:
        return empty(R, dev)
    top = (torch.stack(alt_i, 1), torch.stack(alt_p, 1)) if F else None
    return slots(torch.stack(toks, 1), batch.k, torch.stack(draft_probs, 1).float() if sampled else None, top=top)


def pad(part: Proposal, have: tuple[int, ...], want: tuple[int, ...], valid: list[int], dev) -> Proposal:
    """``part`` (``have[i]`` slots per request) widened to ``want[i]`` slots (filler after), ``num_valid`` = ``valid``."""
    nv = torch.tensor(valid, dtype=torch.long)
    if have == want:
        return replace(part, num_valid=nv)
    cu_w = cumulative(want)
    at = torch.tensor([cu_w[i] + j for i, n in enumerate(have) for j in range(n)], dtype=torch.long).to(dev)
    ids = torch.zeros(cu_w[-1], dtype=torch.long, device=dev)
    ids[at] = part.draft_token_ids
    probs = None
    if part.draft_probs is not None:
        probs = torch.zeros(cu_w[-1], part.draft_probs.shape[1], device=dev)
        probs[:, 0] = 1   # filler rows: valid distributions, never verified
        probs[at] = part.draft_probs
    return Proposal(draft_token_ids=ids, cu_num_draft_tokens=torch.tensor(cu_w).to(dev), draft_probs=probs,
                    num_valid=nv)
