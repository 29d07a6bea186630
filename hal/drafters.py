"""Drafters behind one interface (`hal.requests.Drafter`): n-gram prompt lookup, a
separate draft model (or the target's first L layers: self-speculative), and an
EAGLE-style head hook. Each reads a `DraftBatch` and returns a `Proposal` on its own
device; none reads anything back to the host."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from hal import kv
from hal.errors import HalError
from hal.forward import forward_tokens, readback, sampling_tensors
from hal.models.llama import Llama
from hal.placement import transfer
from hal.requests import DraftBatch, Proposal


def slots(drafts: Tensor, k: tuple[int, ...], probs: Tensor | None = None, num_valid=None) -> Proposal:
    """A `Proposal` from padded drafts ``[R, K]`` (and q ``[R, K, V]``): the first ``k[i]`` of row i."""
    R, K = drafts.shape[0], drafts.shape[1] if drafts.dim() == 2 else 0
    dev = drafts.device
    idx = torch.tensor([i * K + j for i, n in enumerate(k) for j in range(n)], dtype=torch.long).to(dev)
    cu = torch.tensor([0, *k], dtype=torch.long).cumsum(0).to(dev)
    ids = drafts.reshape(-1)[idx].long()
    q = None if probs is None else probs.reshape(R * K, -1)[idx]
    return Proposal(ids, cu, q, num_valid)


def empty(R: int, device) -> Proposal:
    return slots(torch.zeros(R, 0, dtype=torch.long, device=device), (0,) * R)


class NgramDrafter:
    """Prompt lookup through the backend's ``ngram_propose`` (vLLM semantics).

    ``lookahead``: it needs only the device history, so the engine runs it before its
    readback. ``shadow``: drafts are free and deterministic, so a router may have it
    draft for requests routed to k = 0 and score the first draft against the emitted token."""

    shadow = True
    lookahead = True

    def __init__(self, backend, min_n: int = 1, max_n: int = 3):
        self.be, self.min_n, self.max_n = backend, min_n, max_n

    def propose(self, b: DraftBatch) -> Proposal:
        dev = torch.device(self.be.device_type)
        K = max(b.k, default=0)
        if K == 0:
            return empty(len(b.rids), dev)
        d, n = self.be.ngram_propose(transfer(b.history, dev), transfer(b.num_tokens, dev), self.min_n, self.max_n, K)
        return slots(d, b.k, None, torch.minimum(n, torch.tensor(b.k).to(dev)))

    def commit(self, rids, kept) -> None:
        pass

    def release(self, rid) -> None:
        pass


class NgramTreeDrafter:
    """Prompt lookup as a draft tree: the continuations found by each n-gram length
    (``max_n`` down to ``min_n``, each through ``ngram_propose``) are branches of one trie,
    longest match first, up to k nodes per request. Shared prefixes are one node. One host
    read per step (the candidates, to build the trie); drafts are deterministic."""

    def __init__(self, backend, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise HalError(f"min_n, max_n: expected 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.be, self.min_n, self.max_n = backend, min_n, max_n

    def propose(self, b: DraftBatch) -> Proposal:
        dev = torch.device(self.be.device_type)
        K, R = max(b.k, default=0), len(b.rids)
        if K == 0:
            return empty(R, dev)
        hist, num = transfer(b.history, dev), transfer(b.num_tokens, dev)
        found = [self.be.ngram_propose(hist, num, n, n, K) for n in range(self.max_n, self.min_n - 1, -1)]
        drafts, counts = readback(torch.stack([d for d, _ in found], 1), torch.stack([c for _, c in found], 1))
        C = len(found)
        ids, parents, valid = [], [], []
        for i, k in enumerate(b.k):
            children: dict[tuple[int, int], int] = {}   # (parent node, token) -> node
            toks, par = [], []
            for c in range(C):
                at = -1
                for j in range(int(counts[i * C + c])):
                    t = int(drafts[(i * C + c) * K + j])
                    if (at, t) not in children:
                        if len(toks) == k:
                            break
                        children[(at, t)] = len(toks)
                        toks.append(t)
                        par.append(at)
                    at = children[(at, t)]
            valid.append(len(toks))
            ids += toks + [0] * (k - len(toks))
            parents += par + list(range(len(par) - 1, k - 1))   # filler: a chain under the last node
        cu = torch.tensor([0, *b.k]).cumsum(0)
        up = lambda v: torch.tensor(v, dtype=torch.long).to(dev)  # noqa: E731
        return Proposal(up(ids), cu.to(dev), None, tuple(valid), up(parents))

    def commit(self, rids, kept) -> None:
        pass

    def release(self, rid) -> None:
        pass


def subset(b: DraftBatch, keep: list[int]) -> DraftBatch:
    """The rows ``keep`` of a `DraftBatch` (its features too)."""
    pick = lambda t: t[torch.tensor(keep, dtype=torch.long).to(t.device)]  # noqa: E731
    feats, counts = b.features, b.num_features
    if feats is not None:
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        feats = pick_rows(feats, [j for i in keep for j in range(cu[i], cu[i + 1])])
        counts = tuple(counts[i] for i in keep)
    return DraftBatch(tuple(b.rids[i] for i in keep), tuple(b.params[i] for i in keep), pick(b.history),
                      pick(b.num_tokens), None if b.lengths is None else tuple(b.lengths[i] for i in keep),
                      tuple(b.k[i] for i in keep), tuple(b.offsets[i] for i in keep),
                      None if b.hidden is None else pick(b.hidden), feats, counts)


def pick_rows(t: Tensor, rows: list[int]) -> Tensor:
    return t[torch.tensor(rows, dtype=torch.long).to(t.device)]


def widen(b: DraftBatch, keep: list[int], part: Proposal | None, dev) -> Proposal:
    """A `Proposal` for all of ``b`` from one for its rows ``keep``: the others get their
    ``k`` slots as filler (``num_valid`` 0)."""
    cu = [0]
    for k in b.k:
        cu.append(cu[-1] + k)
    at = torch.tensor([cu[i] + j for i in keep for j in range(b.k[i])], dtype=torch.long).to(dev)
    ids = torch.zeros(cu[-1], dtype=torch.long, device=dev)
    probs = None
    if part is not None and len(at):
        ids[at] = part.draft_token_ids
        if part.draft_probs is not None:
            probs = torch.zeros(cu[-1], part.draft_probs.shape[1], device=dev)
            probs[:, 0] = 1   # filler slots: valid rows, never verified
            probs[at] = part.draft_probs
    kept = set(keep)
    return Proposal(ids, torch.tensor(cu).to(dev), probs, tuple(k if i in kept else 0 for i, k in enumerate(b.k)))


def _sample_chain(b: DraftBatch, be, dev, step: Callable[[Tensor, int], Tensor]) -> Proposal:
    """Draft max(k) tokens by ``step(x, j) -> logits`` (x: the previous draft), sampling each
    request with its own parameters at Philox offset ``offsets[i] + j``."""
    R, K = len(b.rids), max(b.k, default=0)
    temp, top_k, top_p = sampling_tensors(b.params, [1] * R, dev)
    seeds = torch.tensor([p.seed for p in b.params], dtype=torch.long).to(dev)
    off = torch.tensor(b.offsets, dtype=torch.long).to(dev)
    toks, qs, x = [], [], None
    for j in range(K):
        tok, q = be.sample(step(x, j).float(), temp, top_k, top_p, seeds, off + j)
        x = tok.long()
        toks.append(x)
        qs.append(q)
    sampled = any(p.temperature > 0 for p in b.params)
    if not toks:
        return empty(R, dev)
    return slots(torch.stack(toks, 1), b.k, torch.stack(qs, 1).float() if sampled else None)


class ModelDrafter:
    """A draft model with its own KV pool, on its own backend (device) if wanted.

    Its KV holds a prefix of each request's history plus its own drafts; ``propose``
    keeps the part that `commit` confirmed, catches up in one ragged forward, then drafts
    autoregressively, sampling with the request's own parameters and returning the q it
    sampled from."""

    def __init__(self, model: Llama, num_blocks: int = 512, block_size: int = 16, pool: kv.KVPool | None = None):
        self.model = model
        cfg = model.cfg
        self.pool = pool or kv.KVPool(model.be, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                                      num_layers=model.num_layers, device=model.device)
        self.seqs: dict[int, kv.Sequence] = {}
        self.valid: dict[int, int] = {}   # rid -> leading tokens of its draft KV known to be committed history
        self.cached: dict[int, int] = {}  # rid -> tokens in its draft KV after the last propose
        self.pool_full = 0                # requests left without drafts for a step: the draft pool was full

    def propose(self, b: DraftBatch) -> Proposal:
        """Drafts for every request whose chain fits the draft pool; when it is full, the
        latest requests' draft caches are dropped and they get no drafts this step (they
        decode plainly; ``pool_full`` counts them)."""
        if b.lengths is None:
            raise HalError("ModelDrafter.propose: expected host lengths (it is not a lookahead drafter), got None")
        K = max(b.k, default=0)
        keep = self._make_room(b, K)
        if len(keep) == len(b.rids):
            return self._propose(b)
        return widen(b, keep, self._propose(subset(b, keep)) if keep else None, self.model.device)

    def _make_room(self, b: DraftBatch, K: int) -> list[int]:
        """Rows whose draft chains fit the draft pool, freeing the latest requests' caches
        until they do."""
        a = self.pool.allocator
        need = {rid: max(0, -(-(L + K - 1) // a.block_size) - len(self.seqs[rid].blocks if rid in self.seqs else ()))
                for rid, L in zip(b.rids, b.lengths)} if K else {}
        drop = set()
        for rid in sorted(b.rids, reverse=True):
            if sum(n for r, n in need.items() if r not in drop) <= a.num_free:
                break
            drop.add(rid)
            self.release(rid)
            need[rid] = 0
            self.pool_full += 1
        return [i for i, rid in enumerate(b.rids) if rid not in drop]

    def _propose(self, b: DraftBatch) -> Proposal:
        dev = self.model.device
        hist = transfer(b.history, dev)
        seqs, lens, rows, cols = [], [], [], []
        for i, (rid, L) in enumerate(zip(b.rids, b.lengths)):
            q = self.seqs.setdefault(rid, self.pool.sequence())
            n = min(self.valid.get(rid, 0), L - 1)   # feed at least the last token
            q.truncate(n)
            seqs.append(q)
            lens.append(L - n)
            rows += [i] * (L - n)
            cols += range(n, L)
            self.valid[rid] = n
        K = max(b.k, default=0)
        if K == 0:
            return empty(len(b.rids), dev)
        up = lambda v: torch.tensor(v, dtype=torch.long).to(dev)  # noqa: E731
        first = hist[up(rows), up(cols)]

        def step(x, j):
            tokens, ns = (first, lens) if j == 0 else (x, [1] * len(seqs))
            logits, _ = forward_tokens(self.model, self.pool, seqs, ns, tokens)
            for q, n in zip(seqs, ns):
                q.commit(n)
            return logits
        prop = _sample_chain(b, self.model.be, dev, step)
        for rid, L in zip(b.rids, b.lengths):  # the KV holds the history and drafts 1..K-1
            self.valid[rid], self.cached[rid] = L, L + K - 1
        return prop

    def commit(self, rids, kept) -> None:
        for rid, n in zip(rids, kept):
            if rid in self.cached:
                self.valid[rid] = min(self.cached.pop(rid), n)

    def release(self, rid) -> None:
        if (q := self.seqs.pop(rid, None)) is not None:
            q.free()
        self.valid.pop(rid, None)
        self.cached.pop(rid, None)


EagleHead = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""An EAGLE-style head: ``(hidden [M, H], token_ids [M]) -> (logits [M, V], next_hidden [M, H])``,
where ``hidden`` is the target's final hidden state at the position that produced ``token_ids``."""


class EagleDrafter:
    """Drafts by chaining an EAGLE-style head from the target's last hidden state."""

    def __init__(self, head: EagleHead, backend):
        self.head, self.be = head, backend

    def propose(self, b: DraftBatch) -> Proposal:
        if b.hidden is None:
            raise HalError("EagleDrafter.propose: expected the target's hidden states (DraftBatch.hidden), got None")
        h = b.hidden
        last = b.history.gather(1, (b.num_tokens - 1).clamp(min=0)[:, None])[:, 0]
        state = {"h": h}

        def step(x, j):
            logits, state["h"] = self.head(state["h"], last.to(h.device) if x is None else x)
            return logits
        return _sample_chain(b, self.be, h.device, step)

    def commit(self, rids, kept) -> None:
        pass

    def release(self, rid) -> None:
        pass
