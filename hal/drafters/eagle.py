"""Drafting with an EAGLE head (`hal.models.eagle.EagleModel`): `EagleDrafter` keeps the head's own KV
and is passed every target feature once; `NgramOrHead` takes n-gram lookup's drafts where it
matches and the head's elsewhere. Both are `hal.engine.drafting.Drafter` s with ``features``."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from hal import kv
from hal.engine import trees
from hal.ops import cumulative
from hal.drafters.draft_kv import DraftKV
from hal.drafters.batching import empty, sample_chain, slot_rows, slots, subset, widen
from hal.models.eagle import EagleModel
from hal.engine.forward import make_batch, readback
from hal.errors import HalError
from hal.engine.drafting import DraftBatch, Proposal


class EagleDrafter:
    """Drafts a chain with an `EagleModel` (a `hal.engine.drafting.Drafter` with ``features``).

    Per request its KV holds the pairs (f_t, x_{t+1}) of every committed position whose
    target feature it was passed (``valid``); each `propose` drops its previous scratch
    steps, feeds the new pairs in one ragged forward (the last one again when nothing is
    new), then drafts ``k`` tokens, each step feeding the head's own output back. A request
    whose features it missed (its KV was dropped while the request kept running) gets no
    drafts again (``lost`` counts them). A request asked for no drafts (``k`` 0: n-gram lookup
    covers it, `NgramOrHead`, or a batch-mate drafts) has its new features held, up to `HOLD`
    rows, and fed with its next draft: a step that drafts nothing from the head runs no head forward.

    ``tree=(topk, depth)``: EAGLE-2's dynamic tree instead of a chain (`_tree`), for greedy and
    sampled requests alike (siblings are deterministic, so sampled ones verify exactly).

    ``shadow``: a greedy first draft costs no head step (it comes from the feed of the new
    features, which runs anyway), so a router may score it for requests it routed to k = 0 and
    keep learning their acceptance (without it, a request routed off early stayed off: open chat
    routed 1.05x in one of three runs, 1.24-1.44x with it; measured in the session notes).

    ``own_features``: a chain's `Proposal.own_features` are the head's outputs it drew each
    slot from (its guesses of the target's features), and a `DraftBatch` may end a history with
    an uncommitted tail fed with such guesses (`DraftBatch.own_features`): those pairs go into
    the scratch KV only, so the draft worker drafts the next round ahead of verification."""

    shadow = True
    own_features = True

    def __init__(self, head: EagleModel, num_blocks: int = 512, block_size: int = 16,
                 tree: tuple[int, int] | None = None):
        if tree is not None and not (len(tree) == 2 and all(isinstance(v, int) and v >= 1 for v in tree)):
            raise HalError(f"tree: expected None or (topk >= 1, depth >= 1), got {tree!r}")
        self.head, self.be, self.tree = head, head.be, tree
        c = head.cfg
        self.pool = kv.KVPool(head.be, num_blocks, block_size, c.kv_heads, c.head_dim, num_layers=1,
                              device=head.device)
        self.draft_kv = DraftKV(self.pool)         # valid: pairs from target features in each request's KV (0..valid-1)
        self.last: dict[int, Tensor] = {}    # rid -> the newest target feature passed (position valid - 1)
        self.held: dict[int, list[Tensor]] = {}   # rid -> features passed, not yet fed (positions from valid_len)
        self.lost_rids: set[int] = set()
        self.lost = 0

    @property
    def features(self) -> tuple[int, ...]:
        return self.head.feature_layers

    @property
    def device(self):
        return self.head.device

    @property
    def kind(self) -> str:
        """The per-drafter metrics' label: ``eagle`` or ``eagle3`` (vLLM's method names)."""
        return "eagle3" if self.head.cfg.version == 3 else "eagle"

    def propose(self, batch: DraftBatch) -> Proposal:
        if batch.lengths is None:
            raise HalError("EagleDrafter.propose: expected host lengths (it is not a lookahead drafter), got None")
        if batch.features is None and sum(batch.num_features):
            raise HalError("EagleDrafter.propose: expected DraftBatch.features, got None")
        if batch.own_features is not None:
            self._check_own(batch)
        dev = self.head.device
        cu = cumulative(batch.num_features or (0,) * len(batch.rids))
        own = batch.num_own or (0,) * len(batch.rids)
        keep, plan, K = [], [], max(batch.k, default=0)
        if self.tree is not None and K:   # the re-fed expanded nodes of the deepest level
            K = self.tree[0] * (self.tree[1] - 1)
        need = 0
        for i, (rid, length) in enumerate(zip(batch.rids, batch.lengths)):
            n, m, held = cu[i + 1] - cu[i], own[i], sum(len(f) for f in self.held.get(rid, ()))
            start, v = length - 1 - n - m, self.draft_kv.valid_len(rid) + held
            if (batch.k[i] == 0 and not m and start <= v and rid not in self.lost_rids
                    and held + n - max(0, v - start) <= HOLD and (n or held or rid in self.last)):
                self._hold(rid, batch.features[cu[i] + max(0, v - start):cu[i + 1]] if n > v - start else None)
                continue
            grow = self.draft_kv.blocks_needed(rid, length - 1 + K)
            if m and (start > v or need + grow > self.draft_kv.num_free):
                continue                      # a tail drafted ahead that does not fit: no drafts, nothing lost
            need += grow
            if (start > v or (n + m == 0 and rid not in self.last) or rid in self.lost_rids
                    or need > self.draft_kv.num_free):
                self._lose(rid)
                continue
            keep.append(i)
            plan.append((rid, length, max(0, v - start), m))   # skip features it already has
        if not keep:   # nothing drafted (a tree head's filler slots are children of the root, as `widen`'s)
            out = empty(len(batch.rids), dev) if not any(batch.k) else widen(batch, [], None, dev)
            return out if self.tree is None else replace(
                out, parent_ids=torch.full((out.draft_token_ids.numel(),), -1, dtype=torch.long, device=dev))
        sub = batch if len(keep) == len(batch.rids) else subset(batch, keep)
        part = self._propose(sub, plan)
        return part if sub is batch else widen(batch, keep, part, dev)

    def _check_own(self, batch: DraftBatch) -> None:
        """`DraftBatch.own_features`: a chain head's, one row of the head's width per tail token,
        each tail shorter than its history."""
        own, H = batch.own_features, self.head.cfg.hidden
        if self.tree is not None:
            raise HalError("EagleDrafter.propose: expected no DraftBatch.own_features for a tree head (it drafts "
                           "chains ahead only), got some", arg="DraftBatch.own_features")
        if len(batch.num_own) != len(batch.rids) or any(not 0 <= m < n for m, n in zip(batch.num_own, batch.lengths)):
            raise HalError(f"EagleDrafter.propose: expected DraftBatch.num_own, one tail length in 0..length-1 per "
                           f"request ({len(batch.rids)}), got {batch.num_own} for lengths {batch.lengths}",
                           arg="DraftBatch.num_own")
        if tuple(own.shape) != (sum(batch.num_own), H) or not own.is_floating_point():
            raise HalError(f"EagleDrafter.propose: expected DraftBatch.own_features [{sum(batch.num_own)}, {H}] "
                           f"floating point (the head's own features), got {own.dtype} {list(own.shape)}",
                           arg="DraftBatch.own_features")

    def _propose(self, b: DraftBatch, plan) -> Proposal:
        dev, head = self.head.device, self.head
        feats = None if b.features is None else b.features.to(dev, torch.float32)
        guesses = None if b.own_features is None else b.own_features.to(dev, torch.float32)
        inputs, toks, seqs, lens = [], [], [], []
        hist = b.history.to(dev)
        end = end_own = 0
        for i, ((rid, length, skip, m), n) in enumerate(zip(plan, b.num_features or (0,) * len(plan))):
            a, z, end = end + skip, end + n, end + n    # this request's rows of b.features, minus those it has
            seq = self.draft_kv.sequence(rid)
            x = None                      # m > 0 with nothing new: the tail's pairs alone
            held = [f.to(dev, torch.float32) for f in self.held.pop(rid, ())] + ([feats[a:z]] if z > a else [])
            if held:                      # new target features (held ones first): positions L-1-len .. L-2
                x = torch.cat(held) if len(held) > 1 else held[0]
                self.last[rid] = x[-1]
            elif not m:                   # nothing new: feed the newest pair again
                x = self.last[rid][None]
            mine = guesses[end_own:end_own + m] if m else None   # the uncommitted tail's pairs: own features
            end_own += m
            n_fed = (0 if x is None else x.shape[0]) + m
            p0 = length - 1 - n_fed
            seq.truncate(p0)
            inputs.append((x, mine))
            toks.append(hist[i, p0 + 1:length])
            seqs.append(seq)
            lens.append(n_fed)
            self.draft_kv.mark_valid(rid, length - 1 - m)
        tokens, x, from_target = torch.cat(toks), *self._inputs(inputs, guesses is not None)
        batch = make_batch(self.be, dev, self.pool, seqs, lens, tokens)
        logits0, h = head.forward(batch, self.pool.k[0], self.pool.v[0], tokens, x, from_target)
        for seq, n in zip(seqs, lens):
            seq.commit(n)
        state = {"h": h[batch.logits_rows]}
        if self.tree is not None:
            return self._tree(b, seqs, logits0, state["h"])
        if all(p.temperature == 0 for p in b.params):   # greedy: argmax over the draft vocabulary, no sampler
            return self._greedy_chain(b, seqs, logits0, state["h"])
        own = []

        def step(prev, j):
            if j:
                logits, state["h"] = self._feed(seqs, prev, state["h"])
            own.append(state["h"])
            return head.full_logits(logits0 if j == 0 else logits)
        prop = sample_chain(b, self.be, dev, step)
        return replace(prop, own_features=slot_rows(torch.stack(own, 1).float(), b.k)) if own else prop

    def _inputs(self, inputs: list[tuple[Tensor, Tensor | None]], own: bool) -> tuple[Tensor, bool]:
        """The feed's feature rows, request after request, and whether they are the target's:
        with any own features in the batch the target's are fused first (row by row, so each
        row's bits are the ones the head's own fusion gives), then each request's own follow."""
        if not own:
            return torch.cat([x for x, _ in inputs]), True
        rows = [t for x, mine in inputs for t in (None if x is None else self.head.fuse(x), mine) if t is not None]
        return torch.cat(rows), False

    def _feed(self, seqs, tokens: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """One draft step: each request's previous draft with the head's own output (scratch KV)."""
        bt = make_batch(self.be, self.head.device, self.pool, seqs, [1] * len(seqs), tokens)
        logits, h = self.head.forward(bt, self.pool.k[0], self.pool.v[0], tokens, h, False)
        for q in seqs:
            q.commit(1)
        return logits, h

    def _greedy_chain(self, b: DraftBatch, seqs, logits: Tensor, h: Tensor) -> Proposal:
        """The argmax chain; with ``b.alternatives`` = F each slot's F likeliest tokens under
        softmax(logits) too, and each slot's state as its own feature."""
        head, dev, toks, own, top = self.head, self.head.device, [], [], []
        to_target = (lambda t: t) if head.draft_ids is None else (lambda t: head.draft_ids[t])  # noqa: E731
        for j in range(max(b.k, default=0)):
            if j:
                logits, h = self._feed(seqs, toks[-1], h)
            own.append(h)
            toks.append(to_target(logits.argmax(-1)))
            if b.alternatives:
                p, i = torch.softmax(logits.float(), -1).topk(min(b.alternatives, logits.shape[-1]), -1)
                top.append((to_target(i), p))
        if not toks:
            return slots(torch.zeros(len(seqs), 0, dtype=torch.long, device=dev), b.k)
        alts = (torch.stack([i for i, _ in top], 1), torch.stack([p for _, p in top], 1)) if top else None
        return slots(torch.stack(toks, 1), b.k, top=alts, own=torch.stack(own, 1).float())

    def _tree(self, batch: DraftBatch, seqs, logits: Tensor, h: Tensor) -> Proposal:
        """EAGLE-2's dynamic tree, on the device. The root's ``topk`` likeliest tokens are the
        first candidates; each level expands the ``topk`` candidates of best total log
        probability (their pairs (parent's output, token) fed as a tree over the head's scratch
        KV, every expanded node again each level) into ``topk`` children each. Request i gets
        the ``k[i]`` best candidates overall (a parent scores at least its child, and ties go
        to the earlier one), in candidate order so parents come first."""
        head, dev, (K, D) = self.head, self.head.device, self.tree
        R, B = len(seqs), max(batch.k, default=0)
        to_target = (lambda t: t) if head.draft_ids is None else (lambda t: head.draft_ids[t])  # noqa: E731
        score, tok = torch.log_softmax(logits.float(), -1).topk(K)             # [R, K]: the root's children
        toks, scores, pars = [to_target(tok)], [score], [torch.full((R, K), -1, device=dev)]
        front = torch.arange(K, device=dev).expand(R, K)                       # candidate ids of the expanded level
        feat = h[:, None].expand(R, K, h.shape[-1])                            # their inputs: the parent's output
        fed_tok, fed_feat, fed_par, n = [], [], [], K
        for d in range(1, min(D, B)):
            fed_tok.append(torch.cat(toks, 1).gather(1, front))
            fed_feat.append(feat)
            fed_par.append(torch.full((R, K), -1, device=dev) if d == 1 else (d - 2) * K + pick // K)
            W = d * K
            parents = torch.cat(fed_par, 1).reshape(-1)
            seen = trees.ancestors(parents, [W] * R, dev)[:, 1:, 1:]
            depth = (seen.sum(-1) - 1).reshape(-1)
            rows = (torch.arange(R, device=dev)[:, None] * W + (W - K) + torch.arange(K, device=dev)).reshape(-1)
            tokens = torch.cat(fed_tok, 1).reshape(-1)
            bt = make_batch(self.be, dev, self.pool, seqs, [W] * R, tokens, rows=rows, depth=depth)
            out, hs = head.forward(bt, self.pool.k[0], self.pool.v[0], tokens, torch.cat(fed_feat, 1).reshape(R * W,
                                                                                                              -1),
                                   False, seen.reshape(R * W, W))
            cs, ct = torch.log_softmax(out.float(), -1).topk(K)                # [R * K, K]
            cand = (torch.cat(scores, 1).gather(1, front)[:, :, None] + cs.view(R, K, K)).reshape(R, K * K)
            toks.append(to_target(ct).view(R, K * K))
            scores.append(cand)
            pars.append(front[:, :, None].expand(R, K, K).reshape(R, K * K))
            pick = cand.topk(K).indices                                         # the next level to expand
            front, n = n + pick, n + K * K
            feat = hs[rows].view(R, K, -1).gather(1, (pick // K)[..., None].expand(R, K, hs.shape[-1]))
        return self._select(batch, torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(pars, 1))

    def _select(self, batch: DraftBatch, toks: Tensor, scores: Tensor, pars: Tensor) -> Proposal:
        """Each request's ``k[i]`` best candidates in candidate order, parents remapped."""
        dev, (R, N) = toks.device, toks.shape
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(N, device=dev).expand(R, N))
        k = torch.tensor(batch.k).to(dev)[:, None]
        chosen = torch.sort(torch.where(rank < k, 0, N) + torch.arange(N, device=dev), dim=1).indices  # chosen first
        local = torch.empty_like(chosen).scatter_(1, chosen, torch.arange(N, device=dev).expand(R, N))
        par = pars.gather(1, chosen)
        par = torch.where(par >= 0, local.gather(1, par.clamp(min=0)), -1)
        M = max(batch.k, default=0)
        if M > N:   # more slots than candidates: filler chains under the last node, never verified
            toks_c = torch.cat([toks.gather(1, chosen), toks.new_zeros(R, M - N)], 1)
            par = torch.cat([par, torch.arange(N - 1, M - 1, device=dev).expand(R, M - N)], 1)
        else:
            toks_c = toks.gather(1, chosen)[:, :M]
            par = par[:, :M]
        idx = torch.tensor([i * M + j for i, n in enumerate(batch.k) for j in range(n)], dtype=torch.long).to(dev)
        cu = torch.tensor([0, *batch.k]).cumsum(0).to(dev)
        return Proposal(draft_token_ids=toks_c.reshape(-1)[idx], cu_num_draft_tokens=cu,
                        num_valid=torch.tensor([min(n, N) for n in batch.k]), parent_ids=par.reshape(-1)[idx])

    def _hold(self, rid: int, feats: Tensor | None) -> None:
        """Keep request ``rid``'s new features (positions up to its length - 2) for its next draft."""
        if feats is not None and len(feats):
            self.held.setdefault(rid, []).append(feats)

    def _lose(self, rid: int) -> None:
        if rid not in self.lost_rids:
            self.release(rid)
            self.lost_rids.add(rid)
            self.lost += 1

    def commit(self, rids, kept) -> None:
        pass   # draft steps are scratch: only target features are kept (truncated at the next call)

    def release(self, rid) -> None:
        self.draft_kv.release(rid)
        self.last.pop(rid, None)
        self.held.pop(rid, None)
        self.lost_rids.discard(rid)   # a preempted request comes back with all its features


HOLD = 64   # feature rows a request asked for no drafts may have held, then fed (as `hal.drafters.dspark.HOLD`)


class NgramOrHead:
    """Best of both per request: n-gram lookup's drafts where it finds a match (copy-heavy
    text), the head's elsewhere (open-ended text; a chain or, from a tree head, a tree; the head
    is a `EagleDrafter` or a `hal.drafters.dspark.DSparkDrafter`).
    One extra host read per step (whether the lookup matched); the head is always passed its
    features, drafting 0 tokens for the rows the lookup covers: it holds them (no forward) until it
    drafts for the request again (`EagleDrafter`, `hal.drafters.dspark.DSparkDrafter`). ``shadow`` as
    for the head."""

    def __init__(self, ngram, head):
        self.ngram, self.head, self.be = ngram, head, head.be
        self.shadow = head.shadow     # a block drafter's first draft is not free (`hal.drafters.dspark`)
        self.lookup, self.fallback = ngram.lookup, True   # the router sees where the lookup matches

    @property
    def features(self) -> tuple[int, ...]:
        return self.head.features

    @property
    def kind(self) -> str:
        return f"ngram+{self.head.kind}"

    def propose(self, batch: DraftBatch) -> Proposal:
        dev = self.head.device
        lookup = self.ngram.propose(batch)
        found = list(batch.k) if lookup.num_valid is None else [int(v) for v in readback(lookup.num_valid)[0]]
        use = [f > 0 and k > 0 for f, k in zip(found, batch.k)]
        head_part = self.head.propose(replace(batch, k=tuple(0 if u else k for u, k in zip(use, batch.k))))
        cu = cumulative(batch.k)
        src_ng = [cu[i] + j for i, u in enumerate(use) if u for j in range(batch.k[i])]
        at_ng = src_ng
        at_h = [cu[i] + j for i, u in enumerate(use) if not u for j in range(batch.k[i])]
        ids = torch.zeros(cu[-1], dtype=torch.long, device=dev)
        up = lambda v: torch.tensor(v, dtype=torch.long).to(dev)  # noqa: E731
        if at_ng:
            ids[up(at_ng)] = lookup.draft_token_ids.to(dev)[up(src_ng)]
        if at_h:
            ids[up(at_h)] = head_part.draft_token_ids
        probs = None
        if head_part.draft_probs is not None:   # the lookup's drafts are deterministic: q is a point mass
            probs = torch.zeros(cu[-1], head_part.draft_probs.shape[1], device=dev)
            if at_h:
                probs[up(at_h)] = head_part.draft_probs
            if at_ng:
                probs[up(at_ng), ids[up(at_ng)]] = 1.0
        hv = [0 if u else k for u, k in zip(use, batch.k)] if head_part.num_valid is None else [
            int(v) for v in readback(head_part.num_valid)[0]]
        valid = torch.tensor([min(f, k) if u else hv[i] for i, (u, f, k) in enumerate(zip(use, found, batch.k))])
        parents = None
        if head_part.parent_ids is not None:   # a tree head: the lookup's rows are chains
            parents = up(trees.chain_parents(batch.k))
            if at_h:
                parents[up(at_h)] = head_part.parent_ids.to(dev)
        return Proposal(draft_token_ids=ids, cu_num_draft_tokens=up(cu), draft_probs=probs, num_valid=valid,
                        parent_ids=parents, sources=tuple("ngram" if u else self.head.kind for u in use))

    def commit(self, rids, kept) -> None:
        self.ngram.commit(rids, kept)
        self.head.commit(rids, kept)

    def release(self, rid) -> None:
        self.ngram.release(rid)
        self.head.release(rid)
