"""Prompt lookup drafters: `NgramDrafter` (vLLM's n-gram proposer, a chain) and
`NgramTreeDrafter` (each n-gram length's continuation as a branch of one trie)."""

from __future__ import annotations

import torch

from hal.devices import transfer
from hal.drafters.batching import empty, slots
from hal.engine.forward import readback
from hal.engine.drafting import DraftBatch, Proposal
from hal.errors import HalError


class NgramDrafter:
    kind = "ngram"   # the per-drafter metrics' label (vLLM's method name)
    """Prompt lookup through the backend's ``ngram_propose`` (vLLM semantics).

    ``lookahead``: it needs only the device history, so the engine runs it before its
    readback. ``shadow``: drafts are free and deterministic, so a router may have it
    draft for requests routed to k = 0 and score the first draft against the emitted token."""

    shadow = True
    lookahead = True

    def __init__(self, backend, min_n: int = 1, max_n: int = 3):
        self.be, self.min_n, self.max_n = backend, min_n, max_n

    @property
    def lookup(self) -> tuple[int, int]:
        """Its drafts are prompt lookup's (`hal.engine.drafting.DrafterCapabilities.lookup`)."""
        return self.min_n, self.max_n

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
    kind = "ngram"
    """Prompt lookup as a draft tree: the continuations found by each n-gram length
    (``max_n`` down to ``min_n``, each through ``ngram_propose``) are branches of one trie,
    longest match first, up to k nodes per request. Shared prefixes are one node. One host
    read per step (the candidates, to build the trie); drafts are deterministic."""

    def __init__(self, backend, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise HalError(f"min_n, max_n: expected 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.be, self.min_n, self.max_n = backend, min_n, max_n

    def propose(self, batch: DraftBatch) -> Proposal:
        dev = torch.device(self.be.device_type)
        K, R = max(batch.k, default=0), len(batch.rids)
        if K == 0:
            return empty(R, dev)
        hist, num = transfer(batch.history, dev), transfer(batch.num_tokens, dev)
        found = [self.be.ngram_propose(hist, num, n, n, K) for n in range(self.max_n, self.min_n - 1, -1)]
        drafts, counts = readback(torch.stack([d for d, _ in found], 1), torch.stack([c for _, c in found], 1))
        C = len(found)
        ids, parents, valid = [], [], []
        for i, k in enumerate(batch.k):
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
        cu = torch.tensor([0, *batch.k]).cumsum(0)
        up = lambda v: torch.tensor(v, dtype=torch.long).to(dev)  # noqa: E731
        return Proposal(draft_token_ids=up(ids), cu_num_draft_tokens=cu.to(dev), num_valid=torch.tensor(valid),
                        parent_ids=up(parents))

    def commit(self, rids, kept) -> None:
        pass

    def release(self, rid) -> None:
        pass
