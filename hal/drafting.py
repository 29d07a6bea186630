"""How the engine asks its drafter for drafts: the read-only `DraftBatch` it builds from
the requests in flight, the drafts a step verifies (a prefix of each request's slots,
gathered on the device), and the lookahead call that drafts the next step before the
step's one readback. Functions over data; the engine passes its pieces in."""

from __future__ import annotations

import torch
from torch import Tensor

from hal.forward import readback
from hal.history import HistoryBuffer
from hal.placement import transfer
from hal.requests import DraftBatch, Proposal, State, draft_room

Ahead = tuple[Proposal, dict[int, tuple[int, int]]]   # a lookahead proposal: rid -> (first slot, valid slots)


def view(history: HistoryBuffer, states: list[State], k: list[int], num_tokens: Tensor | None = None,
         width: int | None = None) -> DraftBatch:
    """The drafter's read-only view: host lengths, or (a lookahead call) device ones."""
    rids = [s.rid for s in states]
    lens = [len(s.tokens) for s in states]
    hidden = [s.last_hidden for s in states]
    return DraftBatch(tuple(rids), tuple(s.req for s in states), history.view(rids, width or max(lens, default=0)),
                      num_tokens if num_tokens is not None else torch.tensor(lens).to(history.device),
                      None if num_tokens is not None else tuple(lens), tuple(k),
                      () if num_tokens is not None else tuple(s.offset for s in states),
                      None if any(h is None for h in hidden) or not hidden else torch.stack(hidden))


def drafts_for(drafter, shadow_ok: bool, ahead: Ahead | None, history: HistoryBuffer, live: list[State], dev):
    """The drafts each live request verifies this step: ``(ids [N] on ``dev``, counts, q or
    None, shadow guesses [(live index, flat slot)], the proposal)``. ``shadow_ok``: a router
    scores a free deterministic drafter's first draft for requests routed to k = 0 (those
    drafts are not verified, only compared with the emitted token)."""
    none = (torch.zeros(0, dtype=torch.long, device=dev), [0] * len(live), None, [], None)
    if drafter is None or not live:
        return none
    shadow = {s.rid for s in live if s.req_k == 0 and s.req.temperature == 0 and draft_room(s) > 0} if (
        shadow_ok and getattr(drafter, "shadow", False)) else set()
    if ahead is not None and all(s.rid in ahead[1] for s in live):
        prop, where = ahead               # drafted during the previous step
    else:
        ks = [1 if s.rid in shadow else s.req_k for s in live]
        if not any(ks):
            return none
        prop = drafter.propose(view(history, live, ks))
        for s, k in zip(live, ks):
            s.offset += k
        valid = prop.num_valid
        if valid is None:
            valid = ks
        elif isinstance(valid, Tensor):   # a variable-count drafter outside the lookahead: one more sync
            valid = [int(v) for v in readback(valid)[0]]
        cu = [0]
        for k in ks:
            cu.append(cu[-1] + k)
        where = {s.rid: (cu[i], int(valid[i])) for i, s in enumerate(live)}
    counts = [0 if s.rid in shadow else min(s.req_k, where[s.rid][1]) for s in live]
    guesses = [(i, where[s.rid][0]) for i, s in enumerate(live) if s.rid in shadow and where[s.rid][1] > 0]
    idx = torch.tensor([where[s.rid][0] + j for s, n in zip(live, counts) for j in range(n)], dtype=torch.long)
    ids, q = none[0], None
    if len(idx):
        ids = transfer(prop.draft_token_ids[idx.to(prop.draft_token_ids.device)], dev)
        if prop.draft_probs is not None:
            q = transfer(prop.draft_probs[idx.to(prop.draft_probs.device)], dev)
    return ids, counts, q, guesses, prop


def lookahead(drafter, history: HistoryBuffer, live: list[State], first: list[State], resumed: list[State],
              acc: Tensor | None, dev):
    """A lookahead drafter drafts the next step now, from the device history, for every
    request running after this step: ``live`` (``acc`` accepted drafts + 1 token each, not
    yet on the host), ``first`` (one token) and ``resumed`` (none). Slots: each request's k.
    Returns ``(proposal, (rids, caps, first slots))``, or None."""
    if drafter is None or not getattr(drafter, "lookahead", False):
        return None
    states = live + first + resumed
    if not states:
        return None
    add = [acc.long() + 1] if live else []
    add += [torch.ones(len(first), dtype=torch.long, device=dev), torch.zeros(len(resumed), dtype=torch.long,
                                                                                device=dev)]
    num_tokens = torch.tensor([len(s.tokens) for s in states]).to(dev) + torch.cat(add)
    caps = [max(0, s.req.k) for s in states]
    width = max(len(s.tokens) for s in states) + max(caps, default=0) + 1
    prop = drafter.propose(view(history, states, caps, num_tokens, width))
    cu = [0]
    for c in caps[:-1]:
        cu.append(cu[-1] + c)
    return prop, ([s.rid for s in states], caps, cu)
