"""Drafters behind one interface (`hal.decoder.Drafter`): n-gram prompt lookup, a
separate draft model (or the target's first L layers: self-speculative), and an
EAGLE-style head hook."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from hal import kv
from hal.decoder import State, forward, sampling_args
from hal.models.llama import Llama


class NgramDrafter:
    """Prompt lookup through the backend's ``ngram_propose`` (vLLM semantics).

    ``shadow``: drafts are nearly free and deterministic, so a router may have it draft
    for requests routed to k = 0 and score the first draft against the emitted token."""

    shadow = True

    def __init__(self, backend, min_n: int = 1, max_n: int = 3):
        self.be, self.min_n, self.max_n = backend, min_n, max_n

    def propose(self, states: list[State]) -> tuple[list[list[int]], Tensor | None]:
        L = max(len(s.tokens) for s in states)
        hist = torch.zeros(len(states), L, dtype=torch.long)
        for i, s in enumerate(states):
            hist[i, :len(s.tokens)] = torch.tensor(s.tokens)
        k = max(max(s.req_k for s in states), 1)
        dev = self.be.device_type
        d, n = self.be.ngram_propose(hist.to(dev), torch.tensor([len(s.tokens) for s in states]).to(dev),
                                     self.min_n, self.max_n, k)
        d, n = d.cpu().tolist(), n.cpu().tolist()
        return [d[i][:min(n[i], s.req_k)] for i, s in enumerate(states)], None

    def accepted(self, states, drafted, n_accepted) -> None:
        pass

    def release(self, state) -> None:
        pass


class ModelDrafter:
    """A draft model with its own KV pool, on its own backend (device) if wanted.

    Its KV holds a prefix of each request's history (plus its own earlier drafts);
    ``propose`` keeps the longest cached prefix that matches, catches up in one ragged
    forward, then drafts autoregressively, sampling with the request's own parameters
    and returning the q it sampled from.
    """

    def __init__(self, model: Llama, num_blocks: int = 512, block_size: int = 16, pool: kv.KVPool | None = None):
        self.model = model
        cfg = model.cfg
        self.pool = pool or kv.KVPool(model.be, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                                      num_layers=model.num_layers, device=model.device)
        self.seqs: dict[int, kv.Sequence] = {}
        self.held: dict[int, list[int]] = {}  # the tokens whose KV the draft cache holds, per request

    def propose(self, states: list[State]) -> tuple[list[list[int]], Tensor | None]:
        be = self.model.be
        seqs = [self.seqs.setdefault(s.rid, self.pool.sequence()) for s in states]
        chunks = []
        for s, q in zip(states, seqs):  # keep the longest cached prefix of the history (stale drafts drop here)
            held = self.held.setdefault(s.rid, [])
            n = min(_common_prefix(held, s.tokens), len(s.tokens) - 1)
            q.truncate(n)
            del held[n:]
            chunks.append(s.tokens[n:])
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[Tensor]] = [[] for _ in states]
        K = max(s.req_k for s in states)
        for j in range(K):
            logits, _ = forward(self.model, self.pool, seqs, chunks, False)
            for s, q, c in zip(states, seqs, chunks):
                q.commit(len(c))
                self.held[s.rid] += c
            tok, qd = be.sample(logits, *sampling_args(states, [1] * len(states), self.model.device))
            tok = tok.cpu().tolist()
            for i, s in enumerate(states):
                if j < s.req_k:
                    drafts[i].append(tok[i])
                    probs[i].append(qd[i])
            chunks = [[t] for t in tok]
        sampled = any(s.req.temperature > 0 for s in states)
        rows = [p for ps in probs for p in ps]
        return drafts, (torch.stack(rows).float() if sampled and rows else None)

    def accepted(self, states, drafted, n_accepted) -> None:
        pass  # the next propose keeps the cached prefix that still matches the history

    def release(self, state: State) -> None:
        if (q := self.seqs.pop(state.rid, None)) is not None:
            q.free()
        self.held.pop(state.rid, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


EagleHead = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""An EAGLE-style head: ``(hidden [M, H], token_ids [M]) -> (logits [M, V], next_hidden [M, H])``,
where ``hidden`` is the target's final hidden state at the position that produced ``token_ids``."""


class EagleDrafter:
    """Drafts by chaining an EAGLE-style head from the target's last hidden state."""

    def __init__(self, head: EagleHead, backend):
        self.head, self.be = head, backend

    def propose(self, states: list[State]) -> tuple[list[list[int]], Tensor | None]:
        h = torch.stack([s.last_hidden for s in states])
        x = torch.tensor([s.tokens[-1] for s in states]).to(h.device)
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[Tensor]] = [[] for _ in states]
        for j in range(max(s.req_k for s in states)):
            logits, h = self.head(h, x)
            tok, q = self.be.sample(logits.float(), *sampling_args(states, [1] * len(states), h.device))
            for i, s in enumerate(states):
                if j < s.req_k:
                    drafts[i].append(int(tok[i]))
                    probs[i].append(q[i])
            x = tok.long()
        sampled = any(s.req.temperature > 0 for s in states)
        rows = [p for ps in probs for p in ps]
        return drafts, (torch.stack(rows) if sampled and rows else None)

    def accepted(self, states, drafted, n_accepted) -> None:
        pass

    def release(self, state) -> None:
        pass
