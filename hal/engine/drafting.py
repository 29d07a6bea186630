"""The drafter contract: what a drafter reads (`DraftBatch`, a read-only view of the requests
to draft for), what it returns (`Proposal`, the op contract's CSR layout on its own device),
what it may declare (`DrafterCapabilities`) and the `Drafter` protocol itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class DraftBatch:
    """What a drafter reads: a read-only view of the requests to draft for, one row each.
    Drafters get data, never the engine's state."""

    rids: tuple[int, ...]
    params: tuple          # each request's sampling parameters (`SamplingParams` fields; do not modify)
    history: Tensor        # [R, L] int64 committed token ids (a copy of the engine's `hal.engine.history.HistoryBuffer`
    #                        rows); row i is valid up to num_tokens[i], scratch after
    num_tokens: Tensor     # [R] int64 committed lengths, on the history's device
    lengths: tuple[int, ...] | None  # the same on the host; None on a lookahead call (not known before the readback)
    k: tuple[int, ...]     # draft slots wanted per request
    offsets: tuple[int, ...]  # draft j of request i may draw with Philox (seed, offsets[i] + j)
    hidden: Tensor | None = None  # [R, H] the target's final hidden state at each request's last committed token
    features: Tensor | None = None  # [sum(num_features), F] for a drafter with ``features`` (an EAGLE head): the
    #                                 target's features not passed before, each request's rows in order, ending
    #                                 at the position that produced its last committed token (lengths[i] - 2)
    num_features: tuple[int, ...] = ()
    names: tuple[tuple[bytes, ...], ...] = ()  # per request: the target's prefix-cache names of its leading full
    #                                     blocks of prompt (`hal.kv.block_hashes` in blocks of names_block_size), so
    #                                     a drafter with its own pool may cache them too; () when the target does not
    names_block_size: int = 0
    costs: object = None   # the router's `hal.engine.costs.CostModel` when the engine routes (a drafter that
    #                        schedules its own verification length reads it); None otherwise
    alternatives: int = 0  # F > 0: also return each slot's F likeliest tokens (`Proposal.top_ids`), if the
    #                        drafter has a distribution there; the draft worker ranks its fan-out by them
    own_features: Tensor | None = None  # [sum(num_own), F] for a drafter with ``own_features``: features for each
    #                        history's uncommitted tail (positions lengths[i] - 1 - num_own[i] .. lengths[i] - 2,
    #                        after the target's), the drafter's own guesses of the target's (`Proposal.own_features`
    #                        of an earlier call); for this call only, never kept (the draft worker's fan-out)
    num_own: tuple[int, ...] = ()


def pack_features(per_request: list[list[Tensor]]) -> tuple[Tensor | None, tuple[int, ...]]:
    """`DraftBatch.features` and ``num_features`` from each request's pending feature blocks."""
    flat = [f for blocks in per_request for f in blocks]
    return (torch.cat(flat) if flat else None), tuple(sum(len(f) for f in blocks) for blocks in per_request)


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """What a drafter returns: the op contract's CSR layout, on the drafter's device.

    Row i has exactly ``k[i]`` slots (so the scheduler knows every size without reading
    anything back). ``num_valid`` says how many leading slots are worth verifying (the
    rest are filler): an ``[R]`` int64 tensor, or None (all). A drafter that knows the counts
    on the host keeps the tensor there (reading it costs nothing); a lookahead drafter's may live
    on its device (the engine reads it with its one readback per step). A drafter whose drafts
    are random must not shorten them by looking at the draws (DSpark's counterexample).

    ``parent_ids`` makes each row a draft tree (`hal.ops.Ops.verify_tree`'s layout): slot j's
    local parent, -1 for a child of the root (the last committed token), parents before
    children, so any prefix of the slots is a tree too. Sampled requests verify a tree by
    exact multi-draft rejection: siblings must be deterministic (``draft_probs`` None) or
    i.i.d. draws from their q."""

    draft_token_ids: Tensor            # [N] int64
    cu_num_draft_tokens: Tensor        # [R + 1] int64
    draft_probs: Tensor | None = None  # [N, V] the q each draft was drawn from; None for deterministic drafts
    num_valid: Tensor | None = None      # [R] int64: leading slots worth verifying per row; None: all
    parent_ids: Tensor | None = None   # [N] int64: a tree per row (see above); None: chains
    top_ids: Tensor | None = None      # [N, F] int64: each slot's F likeliest tokens under the drafter
    #                                    (`DraftBatch.alternatives`), likeliest first; None: not asked or unknown
    top_probs: Tensor | None = None    # [N, F] float32: their probabilities (q where sampled, else softmax)
    own_features: Tensor | None = None  # [N, F] float32 from a drafter with ``own_features``: at slot j, its own
    #                                    guess of the target's feature at the position before slot j (the state
    #                                    slot j was drawn from); a later call's `DraftBatch.own_features`
    sources: tuple[str, ...] | None = None   # [R] the method that drafted each row, where a drafter mixes
    #                                          methods (`hal.drafters.eagle.NgramOrHead`); None: its ``kind``


@dataclass(frozen=True)
class DrafterCapabilities:
    """What a drafter may declare, as optional attributes of the same names (read only by
    `capabilities`)."""

    lookahead: bool = False
    """The drafter needs only device data (history, num_tokens), so the engine calls it right
    after verification, before its one host readback, with ``lengths=None`` and ``k`` = each
    request's cap; the next step verifies a prefix of those slots."""
    shadow: bool = False
    """Its drafts are free and deterministic: a router may have it draft one token for
    requests routed to k = 0 and score that draft against the emitted token."""
    features: tuple[int, ...] | None = None
    """Target layer indices: the drafter reads the target's features (`DraftBatch.features`),
    the residual streams entering those layers, concatenated, or for ``()`` the final normed
    hidden state. Each position's feature is passed once, in order, to the first `propose`
    after it was computed. None: no features."""
    own_features: bool = False
    """With ``features``: it also drafts on histories whose last positions have no target
    features yet, from its own guesses of them (`DraftBatch.own_features`, from its earlier
    `Proposal.own_features`), so the draft worker can draft the next round ahead of the
    target's verification (EAGLE-3 / DFlash "training-time test" style)."""
    be: object = None
    """The backend it runs its ops on (read from ``be``, else its ``model``'s), synchronised
    around timings; None: it runs nothing here (a remote drafter)."""
    pool: object = None
    """Its own KV pool (a `hal.kv.KVPool`), reported with the target's in the metrics."""
    lookup: tuple[int, int] | None = None
    """``(min_n, max_n)``: it drafts by prompt lookup first, as `hal.ops.Ops.ngram_propose`
    finds, so a router can tell on the host whether it has a match (`hal.engine.lookup`)."""
    fallback: bool = False
    """With ``lookup``: where the lookup finds nothing it drafts from a model (else nothing)."""


def capabilities(drafter) -> DrafterCapabilities:
    """A drafter's declared `DrafterCapabilities` (absent attributes take the defaults)."""
    if drafter is None:
        return DrafterCapabilities()
    features = getattr(drafter, "features", None)
    be = getattr(drafter, "be", None) or getattr(getattr(drafter, "model", None), "be", None)
    return DrafterCapabilities(bool(getattr(drafter, "lookahead", False)), bool(getattr(drafter, "shadow", False)),
                               None if features is None else tuple(features),
                               features is not None and bool(getattr(drafter, "own_features", False)), be,
                               getattr(drafter, "pool", None), _pair(getattr(drafter, "lookup", None)),
                               bool(getattr(drafter, "fallback", False)))


def _pair(lookup) -> tuple[int, int] | None:
    return None if lookup is None else (int(lookup[0]), int(lookup[1]))


class Drafter(Protocol):
    """Proposes drafts for live requests from a `DraftBatch`. Optional attributes declare
    its `DrafterCapabilities` (``lookahead``, ``shadow``, ``features``)."""

    def propose(self, batch: DraftBatch) -> Proposal:
        """Drafts: exactly ``batch.k[i]`` slots for request i (see `Proposal`)."""

    def commit(self, rids: list[int], kept: list[int]) -> None:
        """After verification: the first ``kept[i]`` tokens of (the history request
        ``rids[i]`` was last drafted from + those drafts) are committed; anything a drafter
        cached beyond them is stale."""

    def release(self, rid: int) -> None:
        """The request finished, was aborted or preempted: drop what is kept for it."""
