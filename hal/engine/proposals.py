"""How the engine asks its drafter for drafts: the read-only `DraftBatch` it builds from
the requests in flight, the drafts a step verifies (a prefix of each request's slots,
gathered on the device), and the lookahead call that drafts the next step before the
step's one readback. Functions over data; the engine passes its pieces in."""

from __future__ import annotations

import torch
from torch import Tensor

from hal.checks import tree_parents
from hal.ops import cumulative
from hal.errors import HalError
from hal.engine.forward import readback
from hal.engine.history import HistoryBuffer
from hal.devices import transfer
from hal.engine.drafting import DraftBatch, Drafter, Proposal, capabilities, pack_features
from hal.engine.requests import State, draft_room
from hal.engine.step_types import Lookahead, StepDrafts


def view(history: HistoryBuffer, states: list[State], k: list[int], num_tokens: Tensor | None = None,
         width: int | None = None, costs=None) -> DraftBatch:
    """The drafter's read-only view: host lengths, or (a lookahead call) device ones."""
    rids = [state.rid for state in states]
    lens = [len(state.tokens) for state in states]
    hidden = [state.last_hidden for state in states]
    ahead = num_tokens is not None   # a lookahead call: lengths are on the device only
    features, num_features = pack_features([state.features for state in states])
    return DraftBatch(rids=tuple(rids), params=tuple(state.req for state in states),
                      history=history.view(rids, width or max(lens, default=0)),
                      num_tokens=num_tokens if ahead else torch.tensor(lens).to(history.device),
                      lengths=None if ahead else tuple(lens), k=tuple(k),
                      offsets=() if ahead else tuple(state.offset for state in states),
                      hidden=None if any(h is None for h in hidden) or not hidden else torch.stack(hidden),
                      features=features, num_features=num_features,
                      names=tuple(tuple(s.names or ()) for s in states) if any(s.names for s in states) else (),
                      names_block_size=states[0].seq.block_size if states else 0, costs=costs)


def check_proposal(prop, ks: list[int]) -> None:
    """`HalError` naming the field unless ``prop`` is a `Proposal` with ``ks[i]`` slots per
    request (shapes only: nothing is read back)."""
    R, N = len(ks), sum(ks)
    if not isinstance(prop, Proposal):
        raise HalError(f"drafter.propose: expected a hal.engine.drafting.Proposal, got {type(prop).__name__}")
    ids, cu, q, valid = prop.draft_token_ids, prop.cu_num_draft_tokens, prop.draft_probs, prop.num_valid
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.shape[0] != N or ids.is_floating_point():
        raise HalError(f"Proposal.draft_token_ids: expected an integer tensor [{N}] (sum of k), got "
                       f"{list(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}")
    if not isinstance(cu, Tensor) or list(cu.shape) != [R + 1]:
        raise HalError(f"Proposal.cu_num_draft_tokens: expected a tensor [{R + 1}], got "
                       f"{list(cu.shape) if isinstance(cu, Tensor) else type(cu).__name__}")
    if q is not None and (not isinstance(q, Tensor) or q.dim() != 2 or q.shape[0] != N):
        raise HalError(f"Proposal.draft_probs: expected None or a tensor [{N}, V], got "
                       f"{list(q.shape) if isinstance(q, Tensor) else type(q).__name__}")
    par = prop.parent_ids
    if par is not None and (not isinstance(par, Tensor) or list(par.shape) != [N] or par.is_floating_point()):
        raise HalError(f"Proposal.parent_ids: expected None or an integer tensor [{N}], got "
                       f"{list(par.shape) if isinstance(par, Tensor) else type(par).__name__}")
    if par is not None and par.device.type == "cpu" and N:   # values too where reading them is free
        tree_parents("Proposal.parent_ids", par, torch.tensor([0, *ks]).cumsum(0))
    if valid is not None and (not isinstance(valid, Tensor) or list(valid.shape) != [R] or valid.is_floating_point()):
        raise HalError(f"Proposal.num_valid: expected None or an integer tensor [{R}], got "
                       f"{list(valid.shape) if isinstance(valid, Tensor) else type(valid).__name__}")


def valid_counts(valid, ks: list[int]) -> list[int]:
    """``num_valid`` as host ints, each checked to lie in [0, k]."""
    out = [int(v) for v in valid]
    for v, k in zip(out, ks):
        if not 0 <= v <= k:
            raise HalError(f"Proposal.num_valid: expected values in [0, k] (k = {k}), got {v}")
    return out


def row_kinds(drafter: Drafter | None, drafts: StepDrafts, n: int) -> list[str] | None:
    """The method that drafted each of the step's ``n`` decoding requests (the metrics' label):
    the proposal's ``sources`` where the drafter mixes methods, else the drafter's ``kind``."""
    if drafter is None:
        return None
    sources = None if drafts.proposal is None else drafts.proposal.sources
    if sources is not None and len(sources) == n:
        return list(sources)
    return [getattr(drafter, "kind", type(drafter).__name__)] * n


def drafts_for(drafter: Drafter | None, scored: set, ahead: Lookahead | None, history: HistoryBuffer,
               live: list[State], ks: list[int], dev, costs=None, host=None) -> StepDrafts:
    """The drafts each live request verifies this step (``ks[i]`` allowed to request i).
    ``scored``: the requests routed to k = 0 whose free deterministic first draft (a shadow
    drafter's; a lookup match's the router scores on the host, `hal.engine.router.Router.guess`)
    the router scores (`hal.engine.router.Router.scored`; not verified, only scored against the
    step's target row).
    ``costs``: the router's cost model, passed on in the `DraftBatch`.
    ``host``: where a router looked up the requests this step, its answer (`host_drafts`).
    Changes no request state: `StepDrafts` says what the engine must advance."""
    nothing = torch.zeros(0, dtype=torch.long, device=dev)
    none = StepDrafts(nothing, [0] * len(live), None, None, [], None, [0] * len(live))
    if drafter is None or not live:
        return none
    shadow = {state.rid for state, k in zip(live, ks) if k == 0 and state.rid in scored and draft_room(state) > 0}
    used, passed = [0] * len(live), False
    want = [1 if state.rid in shadow else k for state, k in zip(live, ks)]   # what the drafter is asked
    if ahead is not None and all(state.rid in ahead.rids for state in live):
        prop = ahead.proposal             # drafted during the previous step
        where = dict(zip(ahead.rids, zip(ahead.first_slot, ahead.valid)))
    else:
        if not any(want):
            return none
        prop = host_drafts(drafter, host, live, want, dev)
        passed = prop is None   # drafted on the host: the drafter is not called, its features wait
        if passed:
            prop = drafter.propose(view(history, live, want, costs=costs))
        check_proposal(prop, want)
        used = want
        # a variable-count drafter outside the lookahead: read its counts (free where they are on the host)
        valid = want if prop.num_valid is None else valid_counts(readback(prop.num_valid)[0], want)
        where = {state.rid: (start, v) for state, start, v in zip(live, cumulative(want), valid)}
    counts = [0 if state.rid in shadow else min(k, where[state.rid][1]) for state, k in zip(live, ks)]
    guesses = [(i, where[state.rid][0]) for i, state in enumerate(live)
               if state.rid in shadow and where[state.rid][1] > 0]
    idx = torch.tensor([where[state.rid][0] + j for state, n in zip(live, counts) for j in range(n)], dtype=torch.long)
    ids, q = nothing, None
    par = None if prop.parent_ids is None else nothing
    if len(idx):
        ids = transfer(prop.draft_token_ids[idx.to(prop.draft_token_ids.device)], dev)
        if prop.draft_probs is not None:
            q = transfer(prop.draft_probs[idx.to(prop.draft_probs.device)], dev)
        if prop.parent_ids is not None:   # a prefix of a row's slots is a tree: local parents stay valid
            par = transfer(prop.parent_ids[idx.to(prop.parent_ids.device)], dev).long()
    return StepDrafts(ids, counts, q, par, guesses, prop, used, passed, asked=want)


PASS_BYTES = 4 << 20   # pending feature bytes a request keeps with the engine on steps drafted on the host


def host_drafts(drafter: Drafter, host, live: list[State], want: list[int], dev) -> Proposal | None:
    """The drafter's proposal read on the host, where it needs no drafter call: it drafts by
    prompt lookup first (`hal.engine.drafting.DrafterCapabilities.lookup`) and ``host(state, k)``,
    a router's host lookup of this step (`hal.engine.router.Router.continuation`), found a match
    for every request asked for ``want[i] > 0`` drafts; there the drafter drafts the lookup's
    continuation, the same tokens (tests/engine/test_lookup.py, tests/engine/test_host_drafts.py).
    None otherwise, and where a request has `PASS_BYTES` of features pending, counted a row per
    step (no walk over them on every step): the drafter holds or feeds them (a request the lookup
    covers for long would otherwise keep its features here without bound). Below that they wait:
    a request that ends before the drafter needs them never costs its catch-up."""
    if host is None or capabilities(drafter).lookup is None:
        return None
    if any(s.features and len(s.features) * s.features[-1][0].numel() * s.features[-1].element_size() >= PASS_BYTES
           for s in live):
        return None
    found = []
    for state, k in zip(live, want):
        tokens = host(state, k) if k else []
        if tokens is None:
            return None
        found.append(tokens)
    ids = [t for tokens, k in zip(found, want) for t in tokens + [-1] * (k - len(tokens))]   # -1: filler slots
    return Proposal(draft_token_ids=torch.tensor(ids, dtype=torch.long).to(dev),
                    cu_num_draft_tokens=torch.tensor(cumulative(want)).to(dev),
                    num_valid=torch.tensor([len(tokens) for tokens in found]), sources=("ngram",) * len(live))


def lookahead(drafter: Drafter | None, history: HistoryBuffer, live: list[State], first: list[State],
              resumed: list[State], acc: Tensor | None, dev, ks: list[int] | None = None,
              asks: set | None = None) -> Lookahead | None:
    """A lookahead drafter drafts the next step now, from the device history, for every
    request running after this step: ``live`` (``acc`` accepted drafts + 1 token each, not
    yet on the host), ``first`` (one token) and ``resumed`` (none). Slots: each request's k.
    ``ks``: this step's k per live request; a sampled request routed to 0 is not drafted for
    (a router that asks it again next step gets its drafts inline: `drafts_for`). ``asks``: where a
    router forecasts whom it asks next step (`hal.engine.router.Router.asks_next`), only those
    live requests are drafted for; a request it asks after all is drafted for inline. The caller
    checks that ``drafter`` drafts ahead (`hal.engine.drafting.DrafterCapabilities.lookahead`)."""
    if drafter is None:
        return None
    if ks is not None and live:
        keep = [i for i, (state, k) in enumerate(zip(live, ks))
                if (state.rid in asks if asks is not None else k or state.req.temperature == 0)]
        if not keep and not first and not resumed:   # nothing to draft ahead: no tensor is touched
            return None
        if len(keep) < len(live):
            live, acc = [live[i] for i in keep], acc[torch.tensor(keep, dtype=torch.long).to(acc.device)]
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
    check_proposal(prop, caps)
    return Lookahead(prop, [s.rid for s in states], caps, cumulative(caps)[:-1])
