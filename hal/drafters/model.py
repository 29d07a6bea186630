"""Model drafters: a separate draft model, or the target's first L layers
(self-speculative), with its own KV pool (`ModelDrafter`). It reads a `DraftBatch` and returns a
`Proposal` on its own device; it reads nothing back to the host."""

from __future__ import annotations


import torch

from hal import kv
from hal.devices import transfer
from hal.drafters.batching import empty, sample_chain, subset, widen
from hal.drafters.draft_kv import DraftKV
from hal.engine.forward import forward_tokens
from hal.engine.drafting import DraftBatch, Proposal
from hal.errors import HalError
from hal.models.llama import Llama


class ModelDrafter:
    kind = "draft_model"   # the per-drafter metrics' label (vLLM's method name)
    """A draft model with its own KV pool, on its own backend (device) if wanted.

    Its KV holds a prefix of each request's history plus its own drafts; ``propose``
    keeps the part that `commit` confirmed, catches up in one ragged forward, then drafts
    autoregressively, sampling with the request's own parameters and returning the q it
    sampled from."""

    def __init__(self, model: Llama, num_blocks: int = 512, block_size: int = 16, pool: kv.KVPool | None = None):
        self.model = model
        cfg = model.cfg
        self.pool = pool or kv.KVPool(model.be, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                                      dtype=model.dtype, num_layers=model.num_layers, device=model.device)
        self.draft_kv = DraftKV(self.pool)  # valid: leading tokens of each request's draft KV that are history
        self.cached: dict[int, int] = {}  # rid -> tokens in its draft KV after the last propose
        self.pool_full = 0                # requests left without drafts for a step: the draft pool was full
        self.pool.allocator.caching = True   # for the target's prefix-cache names (`DraftBatch.names`)
        self.prefix_hits = 0              # history tokens a new request found in this pool's prefix cache

    def propose(self, batch: DraftBatch) -> Proposal:
        """Drafts for every request whose chain fits the draft pool; when it is full, the
        latest requests' draft caches are dropped and they get no drafts this step (they
        decode plainly; ``pool_full`` counts them)."""
        if batch.lengths is None:
            raise HalError("ModelDrafter.propose: expected host lengths (it is not a lookahead drafter), got None")
        K = max(batch.k, default=0)
        keep = self._make_room(batch, K)
        if len(keep) == len(batch.rids):
            return self._propose(batch)
        return widen(batch, keep, self._propose(subset(batch, keep)) if keep else None, self.model.device)

    def _make_room(self, batch: DraftBatch, K: int) -> list[int]:
        """Rows whose draft chains fit the draft pool, freeing the latest requests' caches
        until they do."""
        need = {rid: self.draft_kv.blocks_needed(rid, L + K - 1) for rid, L in zip(batch.rids,
                                                                                   batch.lengths)} if K else {}
        drop = set()
        for rid in sorted(batch.rids, reverse=True):
            if sum(n for r, n in need.items() if r not in drop) <= self.draft_kv.num_free:
                break
            drop.add(rid)
            self.release(rid)
            need[rid] = 0
            self.pool_full += 1
        return [i for i, rid in enumerate(batch.rids) if rid not in drop]

    def _propose(self, batch: DraftBatch) -> Proposal:
        dev = self.model.device
        hist = transfer(batch.history, dev)
        seqs, lens, rows, cols = [], [], [], []
        names = batch.names if batch.names_block_size == self.pool.allocator.block_size else ()
        for i, (rid, length) in enumerate(zip(batch.rids, batch.lengths)):
            fresh = rid not in self.draft_kv.seqs
            seq = self.draft_kv.sequence(rid)
            if fresh and names and names[i]:   # start on the blocks another request cached
                got = seq.adopt(names[i][:(length - 1) // seq.block_size])
                self.draft_kv.mark_valid(rid, got)
                self.prefix_hits += got
            n = min(self.draft_kv.valid_len(rid), length - 1)   # feed at least the last token
            seq.truncate(n)
            seqs.append(seq)
            lens.append(length - n)
            rows += [i] * (length - n)
            cols += range(n, length)
            self.draft_kv.mark_valid(rid, n)
        K = max(batch.k, default=0)
        if K == 0:
            return empty(len(batch.rids), dev)
        up = lambda v: torch.tensor(v, dtype=torch.long).to(dev)  # noqa: E731
        first = hist[up(rows), up(cols)]

        def step(x, j):
            tokens, ns = (first, lens) if j == 0 else (x, [1] * len(seqs))
            logits, _ = forward_tokens(self.model, self.pool, seqs, ns, tokens)
            for seq, n in zip(seqs, ns):
                seq.commit(n)
            return logits
        prop = sample_chain(batch, self.model.be, dev, step)
        for i, (rid, length) in enumerate(zip(batch.rids, batch.lengths)):  # the KV: history, drafts 1..K-1
            self.draft_kv.mark_valid(rid, length)
            self.cached[rid] = length + K - 1
            if names and names[i]:
                self.draft_kv.seqs[rid].name_blocks(names[i], length)
        return prop

    def commit(self, rids, kept) -> None:
        for rid, n in zip(rids, kept):
            if rid in self.cached:
                self.draft_kv.mark_valid(rid, min(self.cached.pop(rid), n))

    def release(self, rid) -> None:
        self.draft_kv.release(rid)
        self.cached.pop(rid, None)

