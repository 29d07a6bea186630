"""Drafting with a DSpark block drafter (`hal.models.dspark.DSparkModel`): one forward proposes a
whole block, the Markov head links it left to right, and the confidence head decides how much
of it the target verifies (`confidence_cut`).

Per request the drafter keeps a context cache: the fused target features of every verified
position, in its own pool (one sequence per request). A call writes the features it was passed
and the block's scratch K/V after them; the next call truncates the scratch, so a rejection
needs no rollback and an accepted prefix costs nothing extra. A request routed to k = 0 (or
covered by n-gram lookup, `hal.drafters.eagle.NgramOrHead`) has its features held, up to `HOLD`
rows, and written with its next block: a step that drafts nothing runs no drafter forward."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from hal import kv
from hal.drafters.batching import empty, pad, sample_chain, slots, subset, widen
from hal.drafters.draft_kv import DraftKV
from hal.engine.drafting import DraftBatch, Proposal
from hal.engine.forward import make_batch
from hal.errors import HalError
from hal.models.dspark import DSparkModel
from hal.ops import cumulative


class DSparkDrafter:
    """A `hal.engine.drafting.Drafter` with ``features`` (the block drafter's taps).

    Request i gets ``min(k[i], model.proposals)`` proposals from one forward (the rest of its ``k[i]``
    slots are filler). With ``batch.costs`` (a routed engine) ``num_valid`` is the confidence
    cut; without, every proposal is verified (a fixed-length block; so on a draft rank, whose
    worker has no cost model). ``confidences`` holds the last call's predicted acceptances per
    request (host floats: one small readback of [R, proposals] per call, free on CPU)."""

    kind = "dspark"   # the per-drafter metrics' label
    shadow = False   # a block costs a forward: requests routed to k = 0 are probed by the router instead

    def __init__(self, model: DSparkModel, num_blocks: int = 512, block_size: int = 16):
        self.model, self.be = model, model.be
        c = model.cfg
        self.pool = kv.KVPool(model.be, num_blocks, block_size, c.kv_heads, c.head_dim, num_layers=c.layers,
                              dtype=model.w["0.wqkv"].dtype, device=model.device)
        self.draft_kv = DraftKV(self.pool)
        self.lost_rids: set[int] = set()
        self.lost = 0
        self.confidences: dict[int, list[float]] = {}
        self.held: dict[int, list[Tensor]] = {}   # rid -> features passed, not yet written (positions from valid_len)

    @property
    def features(self) -> tuple[int, ...]:
        return self.model.cfg.taps

    @property
    def device(self):
        return self.model.device

    def propose(self, batch: DraftBatch) -> Proposal:
        if batch.lengths is None:
            raise HalError("DSparkDrafter.propose: expected host lengths (it is not a lookahead drafter), got None")
        if batch.features is None and sum(batch.num_features):
            raise HalError("DSparkDrafter.propose: expected DraftBatch.features, got None")
        dev, B = self.model.device, self.model.cfg.block
        cu = cumulative(batch.num_features or (0,) * len(batch.rids))
        keep, plan, need = [], [], 0
        for i, (rid, length) in enumerate(zip(batch.rids, batch.lengths)):
            held = sum(len(f) for f in self.held.get(rid, ()))
            start, v = length - 1 - (cu[i + 1] - cu[i]), self.draft_kv.valid_len(rid) + held
            need += self.draft_kv.blocks_needed(rid, length - 1 + B)
            if start > v or rid in self.lost_rids or need > self.draft_kv.num_free:
                self._lose(rid)   # features it missed: no drafts for this request again
                continue
            skip = max(0, v - start)   # the features it already has
            if batch.k[i] == 0 and held + cu[i + 1] - cu[i] - skip <= HOLD:
                self._hold(rid, batch.features[cu[i] + skip:cu[i + 1]] if cu[i + 1] > cu[i] else None)
                continue
            keep.append(i)        # k = 0 past HOLD too: its features go into the context cache now or never
            plan.append((rid, length, skip))
        if not keep:
            return empty(len(batch.rids), dev) if not any(batch.k) else widen(batch, [], None, dev)
        sub = batch if len(keep) == len(batch.rids) else subset(batch, keep)
        part = self._propose(sub, plan)
        return part if sub is batch else widen(batch, keep, part, dev)

    def _forward(self, b: DraftBatch, plan) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        """Write the new context of every request and run the blocks of those with k > 0:
        (base logits [R', P, Vd], hidden [R', P, H] of the P proposing rows, anchors [R'], their rows of ``b``)."""
        m, dev, B = self.model, self.model.device, self.model.cfg.block
        feats = None if b.features is None else b.features.to(dev)
        seqs, ctx_rows, blk_rows, parts, drafting, at, end, row = [], [], [], [], [], [], 0, 0
        for i, ((rid, length, skip), n) in enumerate(zip(plan, b.num_features or (0,) * len(plan))):
            a, end = end + skip, end + n
            held = [f.to(dev) for f in self.held.pop(rid, ())]
            c = sum(len(f) for f in held) + end - a   # context rows written now: the held ones, then the new
            seq = self.draft_kv.sequence(rid)
            seq.truncate(length - 1 - c)     # drops the last call's scratch block
            block = B if b.k[i] else 0       # a request routed to k = 0 only extends its context
            parts += held + ([feats[a:end]] if end > a else [])
            ctx_rows += range(row, row + c)
            blk_rows += range(row + c, row + c + block)
            row += c + block
            if block:
                drafting.append(i)
                at.append(len(seqs))         # its row of the batch's block tables
            if c + block:
                seqs.append((rid, length, seq, c + block))
        if not seqs:
            return None, None, None, []
        up = lambda x: torch.tensor(x, dtype=torch.long).to(dev)  # noqa: E731
        batch = make_batch(self.be, dev, self.pool, [s[2] for s in seqs], [s[3] for s in seqs],
                           torch.zeros(row, dtype=torch.long, device=dev))
        anchors = b.history.to(dev)[up(drafting), up([plan[i][1] - 1 for i in drafting])] if drafting else up([])
        blocks = replace(batch, block_tables=batch.block_tables[up(at)], seq_lens=batch.seq_lens[up(at)],
                         query_start_loc=up([B * i for i in range(len(drafting) + 1)]))   # the block queries
        ctx = torch.cat(parts).float() if parts else torch.zeros(0, m.w["fc"].shape[1], device=dev)
        base, h = m.forward(batch, self.pool.k, self.pool.v, ctx, up(ctx_rows), up(blk_rows), anchors, blocks)
        for rid, length, seq, n in seqs:
            seq.commit(n)
            self.draft_kv.mark_valid(rid, length - 1)
        return base, h, anchors, drafting

    def _propose(self, b: DraftBatch, plan) -> Proposal:
        dev = self.model.device
        base, h, anchors, drafting = self._forward(b, plan)
        if not drafting:
            return empty(len(b.rids), dev) if not any(b.k) else widen(b, [], None, dev)
        d = b if len(drafting) == len(b.rids) else subset(b, drafting)
        part = self._draft(d, base, h, anchors)
        return part if d is b else widen(b, drafting, part, dev)

    def _draft(self, b: DraftBatch, base: Tensor, h: Tensor, anchors: Tensor) -> Proposal:
        """The Markov-chained drafts of every row of ``b`` (each has k > 0), and the cut."""
        m, dev = self.model, self.model.device
        K = min(max(b.k), m.proposals)
        capped = replace(b, k=tuple(min(k, K) for k in b.k))
        conf = []

        def row(prev: Tensor, j: int) -> Tensor:
            r, bias = base[:, j].float(), m.markov(prev)
            r = r if bias is None else r + bias
            c = m.confidence(h[:, j].float(), prev)
            if c is not None:
                conf.append(c)
            return r
        if all(p.temperature == 0 for p in b.params):   # greedy: the argmax of the same rows
            toks, prev = [], anchors
            for j in range(K):
                prev = m.draft_ids[row(prev, j).argmax(-1)]
                toks.append(prev)
            part = slots(torch.stack(toks, 1), capped.k)
        else:
            part = sample_chain(capped, self.be, dev, lambda x, j: m.full_logits(row(anchors if j == 0 else x, j)))
        c = torch.stack(conf, 1).tolist() if conf else None   # None: a layout without a confidence head
        self.confidences = dict(zip(b.rids, c)) if c is not None else {}
        valid = confidence_cut(c, capped.k, b.lengths, b.costs) if b.costs is not None and c is not None \
            else list(capped.k)
        return pad(part, capped.k, b.k, valid, dev)

    def _hold(self, rid: int, feats: Tensor | None) -> None:
        """Keep request ``rid``'s new features for its next block."""
        if feats is not None and len(feats):
            self.held.setdefault(rid, []).append(feats)

    def _lose(self, rid: int) -> None:
        if rid not in self.lost_rids:
            self.release(rid)
            self.lost_rids.add(rid)
            self.lost += 1

    def commit(self, rids, kept) -> None:
        pass   # only verified features are kept; the block is scratch, truncated at the next call

    def release(self, rid) -> None:
        self.draft_kv.release(rid)
        self.lost_rids.discard(rid)
        self.confidences.pop(rid, None)
        self.held.pop(rid, None)


HOLD = 64    # feature rows a request routed to k = 0 may have held, then written: len(taps) x hidden float32
#              each, 0.44 MB a request for SmolLM2's shipped drafter, in the plan's slack as the drafter's own KV is
LOOK = 32   # the cut looks this many positions ahead at a position's own P (a plan's chunk widths are <= 32)


def confidence_cut(conf: list[list[float]], caps: tuple[int, ...], contexts, costs, margin: float = 0.0
                   ) -> list[int]:
    """How many leading proposals of each request to verify (DSpark's confidence scheduling).

    Position j of request i is reached and accepted with predicted chance
    ``P[i][j] = conf[i][0] * ... * conf[i][j]``. Positions are taken in descending P (a request's
    earlier positions first), and each is taken while some run of m more positions at its own P
    would raise the predicted tokens per second of the step (``costs``: the router's
    `hal.engine.costs.CostModel`; drafting is already paid). The first that would not stops the cut.

    Non-anticipating: ``conf[i][j]`` depends on request i's draws before j only, and whether j is
    taken depends on the P ranked above it (its own earlier positions, and other requests',
    drawn independently), never on its token at j or later (tests/engine/test_router.py's
    DSpark counterexample is the case this must not be)."""
    R = len(caps)
    P = [[] for _ in range(R)]
    for i in range(R):
        run = 1.0
        for j in range(caps[i]):
            run *= conf[i][j]
            P[i].append(run)
    order = sorted(((-p, j, i) for i in range(R) for j, p in enumerate(P[i])))
    fed, attn, tokens = R, sum(contexts), float(R)
    taken = [0] * R
    left = len(order)
    for neg, j, i in order:
        p, now = -neg, tokens / costs.cost(fed, attn, 0)
        if not any((tokens + m * p) / costs.cost(fed + m, attn + m * contexts[i], 0) > now * (1 + margin)
                   for m in range(1, min(left, LOOK) + 1)):
            break
        taken[i], fed, attn, tokens, left = taken[i] + 1, fed + 1, attn + contexts[i], tokens + p, left - 1
    return taken
