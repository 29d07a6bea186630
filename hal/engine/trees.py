"""Draft trees in the engine (EAGLE-2 / SpecInfer): a step feeds each request's
``[root, node 0, node 1, ...]`` (the root is its last committed token) with the tree mask,
each node at position context + depth; `hal.ops.Ops.verify_tree` accepts a path; `compact`
moves the path's KV down to contiguous slots with ``copy_kv``. Everything stays on the
device: the layout is built from the parents tensor, the compaction from the accepted nodes.

A chain is the tree ``parents = [-1, 0, 1, ...]``; on the batch-invariant runner every node's
logits are the bits a chain decode of its path computes (`hal.models.invariant`), so greedy
tree decoding equals plain greedy by construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hal import kv
from hal.ops import cumulative
from hal.engine.forward import sampling_args, target_probs


@dataclass
class VerifyOutput:
    out: Tensor              # [R, max_k + 1] int32: accepted drafts, then the bonus/resampled token, -1 padded
    accepted: Tensor         # [R] accepted drafts per request
    nodes: Tensor | None     # [R, max_k] the accepted path's nodes (trees), -1 padded; None for chains


def chain_parents(ks) -> list[int]:
    """Parents making each request's ``ks[i]`` slots a chain (``-1, 0, 1, ...``): the layout
    of a row that is not a tree, or of filler slots, inside a tree proposal."""
    return [j - 1 for k in ks for j in range(k)]


def ancestors(parents: Tensor, counts: list[int], dev) -> Tensor:
    """``[R, W, W]`` bool (W = 1 + max count): fed row i of request r sees fed row j (the
    root is row 0, node n is row 1 + n; padding rows see only themselves)."""
    R, W = len(counts), 1 + max(counts, default=0)
    real = torch.tensor([[j < c for j in range(W - 1)] for c in counts], dtype=torch.bool).view(R, W - 1).to(dev)
    idx = torch.tensor([a + j for a, c in zip(cumulative(counts)[:-1], counts) for j in range(W - 1)],
                       dtype=torch.long).view(R, W - 1).to(dev)
    up = torch.arange(W, device=dev).expand(R, W).clone()     # row -> its parent's row (root, padding: itself)
    if parents.numel():
        # clamped: a malformed tree (refused by `hal.engine.proposals.check_proposal` on the host, by
        # `verify_tree`'s checks elsewhere) must not index out of range first
        par = (parents.to(dev).long()[idx.clamp(max=parents.numel() - 1)] + 1).clamp(0, W - 1)
        up[:, 1:] = torch.where(real, par, up[:, 1:])
    seen = torch.eye(W, dtype=torch.bool, device=dev).expand(R, W, W).clone()
    cur = torch.arange(W, device=dev).expand(R, W)
    for _ in range(W - 1):
        cur = up.gather(1, cur)
        seen.scatter_(2, cur[..., None], True)
    return seen


def layout(parents: Tensor, counts: list[int], extra: list[int], dev) -> tuple[Tensor, Tensor]:
    """The forward's tree metadata for ``len(counts)`` tree requests feeding ``1 + counts[r]``
    rows, followed by requests feeding ``extra[r]`` causal rows (prefill chunks):
    ``(depth [T]`` (a row's position minus its request's first fed position), ``mask [T, W])``."""
    seen = ancestors(parents, counts, dev)
    W = max([seen.shape[1]] + extra)
    rows = [seen[r, :1 + c] for r, c in enumerate(counts)]
    rows += [torch.ones(n, n, dtype=torch.bool, device=dev).tril() for n in extra]
    mask = torch.cat([torch.nn.functional.pad(m, (0, W - m.shape[1])) for m in rows]) if rows else \
        torch.zeros(0, W, dtype=torch.bool, device=dev)
    depth = torch.cat([m.sum(-1) - 1 for m in rows]) if rows else torch.zeros(0, dtype=torch.long, device=dev)
    return depth, mask


def path_rows(nodes: Tensor, counts: list[int], dev) -> Tensor:
    """``[R, max_k + 1]`` flat fed rows whose logits produced each output token of the
    accepted path (the root's, then each accepted node's; padding repeats the root)."""
    base = torch.tensor(cumulative([1 + c for c in counts])[:-1]).to(dev)
    n = nodes.long()
    step = torch.where(n >= 0, n + 1, 0)
    return base[:, None] + torch.cat([torch.zeros_like(step[:, :1]), step], 1)


def verify(backend, live, counts: list[int], ids: Tensor, q: Tensor | None, logits: Tensor,
           parents: Tensor | None, offsets: list[int] | None) -> VerifyOutput:
    """Verify the live requests' drafts (chains, or trees when ``parents`` is given) against
    their rows of ``logits``. All-greedy batches compare argmaxes (``offsets`` None);
    otherwise the target's p (greedy rows get a one-hot p, which verifies exactly as
    greedy) and rejection sampling at each request's Philox ``offsets[i]``."""
    dev = logits.device
    max_k = max(counts)
    greedy = offsets is None
    if greedy and max_k == 0:
        return plain_greedy(backend, logits)
    cu = torch.tensor([0, *counts]).cumsum(0).to(dev)
    if not greedy:
        logits = target_probs(logits, *sampling_args(live, [c + 1 for c in counts], dev), [s.req for s in live])
        seeds = torch.tensor([s.req.seed for s in live]).to(dev)
        offs = torch.tensor(offsets).to(dev)
    if parents is not None:
        out, nodes, acc = backend.verify_tree(ids, cu, parents, logits, *((None, None, None) if greedy else
                                                                     (q, seeds, offs)), max_k)
        return VerifyOutput(out, acc, nodes)
    if greedy:
        out, acc = backend.verify_greedy(ids, cu, logits, max_k)
    else:
        out, acc = backend.verify_rejection(ids, cu, q, logits, seeds, offs, max_k)
    return VerifyOutput(out, acc, None)


def plain_greedy(backend, logits: Tensor) -> VerifyOutput:
    """A greedy step that drafted nothing: `hal.backend.Backend.greedy_rows` (what
    `verify_greedy` emits with no drafts, without its ragged bookkeeping), nothing accepted."""
    out = backend.greedy_rows(logits)
    return VerifyOutput(out, torch.zeros(out.shape[0], dtype=torch.int32, device=logits.device), None)


def compact(backend, pool: kv.KVPool, seqs: list[kv.Sequence], counts: list[int], nodes: Tensor) -> None:
    """Move each request's accepted path (``nodes`` [R, max_k], -1 padded, from `verify_tree`)
    to the slots right after its root, in every layer (a chain's path is already there:
    those copies are to themselves)."""
    dst_host = [s.slot(s.length + 1 + j) for s, c in zip(seqs, counts) for j in range(c)]
    if not dst_host:
        return
    dev = nodes.device
    dst = torch.tensor(dst_host).to(dev)
    r = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)]).to(dev)
    j = torch.tensor([j for c in counts for j in range(c)]).to(dev)
    start = torch.tensor(cumulative(counts)[:-1]).to(dev)
    n = nodes.long()[r, j]
    src = dst[torch.where(n >= 0, start[r] + n.clamp(min=0), start[r] + j)]
    for kc, vc in zip(pool.k, pool.v):
        backend.copy_kv(kc, vc, src, dst)
