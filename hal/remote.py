"""The target's side of the two-rank protocol: `RemoteDrafter`, a `hal.decoder.Drafter`
whose drafts come from the draft worker over a `hal.protocol.Link`. It trusts nothing the
worker sends; a dead, silent or malformed worker leaves plain decoding (counted)."""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from hal.checks import MAX_K, prob_values
from hal.decoder import State
from hal.errors import HalError
from hal.placement import dense_q, transfer
from hal.protocol import (HASH_SEED, Commit, CommitEntry, Drafts, Link, NewRequest, Stop, decode, encode,
                          history_hash)

class RemoteDrafter:
    """The target's view of the draft worker (a `hal.decoder.Drafter`)."""

    def __init__(self, link: Link, vocab: int, device: torch.device, metrics, timeout: float = 30.0,
                 first_timeout: float = 60.0):
        self.link, self.vocab, self.device, self.metrics = link, vocab, device, metrics
        self.timeout, self.first_timeout = timeout, first_timeout
        self.sent: dict[int, int] = {}     # rid -> tokens of its history the worker has
        self.hashes: dict[int, int] = {}   # rid -> history_hash of those tokens
        self.finished: list[int] = []
        self.alive, self.lost, self.rounds, self.guess_hits, self.guess_misses = True, False, 0, 0, 0

    def propose(self, states: list[State]) -> tuple[list[list[int]], Tensor | None]:
        empty = [[] for _ in states], None
        if not self.alive:
            return empty
        live = {s.rid for s in states}
        self.finished += [rid for rid in self.sent if rid not in live]
        for rid in self.finished:
            self.sent.pop(rid, None)
            self.hashes.pop(rid, None)
        msg, self.finished = Commit([], self.finished), []
        for s in states:
            new = None if s.rid in self.sent else NewRequest(s.req.top_k, s.req.seed, s.req.max_new_tokens,
                                                              s.req.temperature, s.req.top_p)
            delta = s.tokens[self.sent.get(s.rid, 0):]
            msg.entries.append(CommitEntry(s.rid, s.req_k, len(s.tokens), delta, new))
            self.sent[s.rid] = len(s.tokens)
            self.hashes[s.rid] = history_hash(delta, self.hashes.get(s.rid, HASH_SEED))
        try:
            self.link.send(*encode(msg)[:2])
            reply = self.link.recv(self.timeout if self.rounds else self.first_timeout)
        except RuntimeError as e:  # gloo: connection reset (the worker died) or a timeout
            self.lost = True
            self._fail(e)
            return empty
        except HalError as e:      # a header out of bounds
            self._fail(e)
            return empty
        self.rounds += 1
        try:
            return self._accept(states, decode(*reply, vocab=self.vocab, max_k=MAX_K))
        except HalError as e:      # the reply is not a valid DRAFTS message: plain decoding from here
            self._fail(e)
            return empty

    def _accept(self, states: list[State], reply) -> tuple[list[list[int]], Tensor | None]:
        """The drafts of a decoded reply (`hal.protocol.decode` checked its structure): one
        entry per request, q rows that are probabilities; drafts not built on the committed
        prefix (base length and hash) are dropped."""
        if not isinstance(reply, Drafts):
            raise HalError(f"draft worker reply: expected DRAFTS, got {type(reply).__name__}")
        if len(reply.entries) != len(states) or not (reply.hits <= len(states) and reply.stale <= len(states)):
            raise HalError(f"draft worker reply: expected {len(states)} entries and overlap counts at most that, "
                           f"got {len(reply.entries)} entries, counts {reply.hits}/{reply.stale}")
        self.guess_hits += reply.hits
        self.guess_misses += reply.stale
        self.metrics.stale_drafts += reply.stale
        drafts, keep, r = [], [], 0
        for s, e in zip(states, reply.entries):
            d, n = e.tokens, len(e.tokens)
            ok = e.rid == s.rid and e.base_len == len(s.tokens) and e.base_hash == self.hashes[s.rid] and n <= max(
                s.req_k, 0)
            if not ok:  # not built on the committed prefix: dropped
                self.metrics.stale_drafts += 1
                d = []
            keep += range(r, r + len(d))
            r += n
            drafts.append(d)
        if reply.q is None or not keep:
            return drafts, None
        rows = transfer(reply.q[keep], self.device)
        q = rows if reply.idx is None else dense_q(transfer(reply.idx[keep], self.device), rows, self.vocab)
        prob_values("draft_probs (from the draft worker)", q)
        return drafts, q

    def _fail(self, e: Exception) -> None:
        self.alive = False
        self.metrics.draft_failures += 1
        print(f"hal.serve: draft worker lost ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
              "finishing every request by plain decoding", file=sys.stderr, flush=True)

    def accepted(self, states, drafted, n_accepted) -> None:
        pass

    def release(self, state: State) -> None:
        self.hashes.pop(state.rid, None)
        if self.sent.pop(state.rid, None) is not None:
            self.finished.append(state.rid)

    def close(self) -> None:
        if not self.lost:  # a worker we stopped listening to (bad reply) still gets its STOP
            try:
                self.link.send(*encode(Stop())[:2])
                self.link.flush()
            except RuntimeError:
                pass
