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
from hal.protocol import COMMIT, DRAFTS, HASH_SEED, STOP, Link, history_hash

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
        words, floats = [COMMIT, len(states), len(self.finished), *self.finished], []
        self.finished = []
        for s in states:
            new = s.rid not in self.sent
            words += [s.rid, s.req_k, len(s.tokens), int(new)]
            if new:
                words += [s.req.top_k, s.req.seed, s.req.max_new_tokens]
                floats.append([s.req.temperature, s.req.top_p])
            delta = s.tokens[self.sent.get(s.rid, 0):]
            words += [len(delta), *delta]
            self.sent[s.rid] = len(s.tokens)
            self.hashes[s.rid] = history_hash(delta, self.hashes.get(s.rid, HASH_SEED))
        try:
            self.link.send(words, torch.tensor(floats) if floats else None)
            reply, rows, idx = self.link.recv(self.timeout if self.rounds else self.first_timeout)
        except RuntimeError as e:  # gloo: connection reset (the worker died) or a timeout
            self.lost = True
            self._fail(e)
            return empty
        except HalError as e:      # a header out of bounds
            self._fail(e)
            return empty
        self.rounds += 1
        try:
            return self._accept(states, reply, rows, idx)
        except HalError as e:      # the reply is not a valid DRAFTS message: plain decoding from here
            self._fail(e)
            return empty

    def _accept(self, states: list[State], reply: list[int], rows, idx) -> tuple[list[list[int]], Tensor | None]:
        """The drafts of a DRAFTS reply. It comes from another process, maybe another host:
        every field is checked (kind, counts, lengths, token ids in [0, V), q rows) and a
        malformed reply raises `HalError`; drafts not built on the committed prefix are dropped."""
        def bad(what: str):
            raise HalError(f"draft worker reply: expected {what}")
        if len(reply) < 3 or reply[0] != DRAFTS:
            bad(f"a DRAFTS message, got kind {reply[0] if reply else None} of {len(reply)} words")
        if not (0 <= reply[1] <= len(states) and 0 <= reply[2] <= len(states)):
            bad(f"overlap counts in [0, {len(states)}], got {reply[1:3]}")
        parsed, at = [], 3
        for s in states:
            if at + 4 > len(reply):
                bad(f"an entry for request {s.rid}, got a reply truncated at word {len(reply)}")
            rid, base_len, base_hash, n = reply[at:at + 4]
            if not 0 <= n <= MAX_K or at + 4 + n > len(reply):
                bad(f"0 <= drafts <= {MAX_K} within the reply for request {s.rid}, got {n}")
            d = reply[at + 4:at + 4 + n]
            if any(not 0 <= t < self.vocab for t in d):
                bad(f"draft token ids in [0, {self.vocab}) for request {s.rid}, got {[t for t in d if not 0 <= t < self.vocab][:4]}")
            parsed.append((rid, base_len, base_hash, d))
            at += 4 + n
        if at != len(reply):
            bad(f"{at} words, got {len(reply)}")
        total = sum(len(p[3]) for p in parsed)
        if rows is not None and (rows.dim() != 2 or rows.shape[0] != total or (idx is None and rows.shape[1] != self.vocab)):
            bad(f"{total} q rows of width {self.vocab}, got shape {list(rows.shape)}")
        if idx is not None and (rows is None or idx.shape != rows.shape or bool(((idx < 0) | (idx >= self.vocab)).any())):
            bad(f"sparse q indices in [0, {self.vocab}) shaped like its values")
        self.guess_hits += reply[1]
        self.guess_misses += reply[2]
        self.metrics.stale_drafts += reply[2]
        drafts, keep, r = [], [], 0
        for s, (rid, base_len, base_hash, d) in zip(states, parsed):
            n = len(d)
            ok = rid == s.rid and base_len == len(s.tokens) and base_hash == self.hashes[s.rid] and n <= max(
                s.req_k, 0)
            if not ok:  # not built on the committed prefix: dropped
                self.metrics.stale_drafts += 1
                d = []
            keep += range(r, r + len(d))
            r += n
            drafts.append(d)
        if rows is None or not keep:
            return drafts, None
        rows = transfer(rows[keep], self.device)
        q = rows if idx is None else dense_q(transfer(idx[keep], self.device), rows, self.vocab)
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
                self.link.send([STOP])
                self.link.flush()
            except RuntimeError:
                pass
