"""The draft worker's side of the two-rank protocol: `draft_worker` answers each COMMIT
with DRAFTS built on exactly the committed prefix, and overlaps the target's verification
by drafting the next round on "all accepted + its own guess of the bonus token"."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import Tensor

from hal.decoder import Request, State
from hal.errors import HalError
from hal.placement import sparse_q
from hal.protocol import (DRAFT_SEED, HASH_SEED, Commit, DraftEntry, Drafts, Link, Stop, corrupted, decode, encode,
                          history_hash)

Guess = dict[int, tuple[list[int], list[int], Tensor | None]]  # rid -> (assumed history, drafts, q rows)


def draft_worker(link: Link, drafter, fault: str = "", idle: float | None = None) -> None:
    """Serve DRAFTS for each COMMIT until STOP (see the module docstring); ``idle``: the
    longest wait for the next COMMIT, in seconds (None: the link's default)."""
    states: dict[int, State] = {}
    hashes: dict[int, int] = {}  # rid -> history_hash of its committed history
    guess: Guess = {}
    replies = 0
    while True:
        msg = decode(*link.recv(idle))   # the target is another process too: checked
        if isinstance(msg, Stop):
            return
        if not isinstance(msg, Commit):
            raise HalError(f"hal.serve worker: expected COMMIT or STOP, got {type(msg).__name__}")
        order = _apply_commit(msg, states, hashes, guess, drafter)
        out, hits, stale = _drafts_for(order, guess, drafter)
        if fault and replies == int(fault.split(":")[1]):  # fault injection for tests: HAL_SERVE_FAULT=
            if fault.startswith("kill"):                   # kill:N (SIGKILL after N replies),
                os.kill(os.getpid(), signal.SIGKILL)       # hang:N:S (stop answering for S s, then exit),
            if fault.startswith("hang"):                   # bad:N:KIND (reply N+1 malformed: KIND is
                time.sleep(float(fault.split(":")[2]))     # kind, truncated, oov, negative or count)
                os._exit(0)
        _reply(link, order, hashes, out, hits, stale,
               fault.split(":")[2] if fault.startswith("bad") and replies == int(fault.split(":")[1]) else "")
        replies += 1
        guess = _guess_next(order, out, drafter)  # overlaps the target's verification


def _apply_commit(msg: Commit, states: dict[int, State], hashes: dict[int, int], guess: Guess,
                  drafter) -> list[State]:
    """Extend each request's committed history (new requests arrive with their sampling
    parameters; finished ones are released). Returns the requests of this round, in order."""
    for rid in msg.finished:
        if (st := states.pop(rid, None)) is not None:
            drafter.release(st)
        guess.pop(rid, None)
        hashes.pop(rid, None)
    order = []
    for e in msg.entries:
        if e.new is not None:
            n = e.new
            req = Request([0], max_new_tokens=n.max_new_tokens, temperature=n.temperature, top_k=n.top_k,
                          top_p=n.top_p, seed=n.seed + DRAFT_SEED, k=e.k)
            states[e.rid] = State(req, e.rid, [], seq=None)
        if e.rid not in states:
            raise HalError(f"hal.serve worker: expected a known request or its parameters, got request {e.rid}")
        st = states[e.rid]
        st.tokens = st.tokens + e.delta
        hashes[e.rid] = history_hash(e.delta, hashes.get(e.rid, HASH_SEED))
        if len(st.tokens) != e.length:
            raise HalError(f"hal.serve: expected a committed history of {e.length} tokens for request {e.rid}, "
                           f"got {len(st.tokens)} (protocol out of step)")
        st.req_k = e.k
        order.append(st)
    return order


def _drafts_for(order: list[State], guess: Guess, drafter):
    """Each request's drafts (and q rows): the overlap guess where it holds (the target
    accepted everything and its bonus token was the draft's guess), else fresh ones."""
    hit_ids = {s.rid for s in order if s.req_k and s.rid in guess and guess[s.rid][0] == s.tokens
               and len(guess[s.rid][1]) >= s.req_k}
    stale = sum(1 for s in order if s.rid in guess and s.rid not in hit_ids)
    out: dict[int, tuple[list[int], Tensor | None]] = {s.rid: ([], None) for s in order}
    for s in order:
        if s.rid in hit_ids:
            _, d, q = guess[s.rid]
            out[s.rid] = (d[:s.req_k], None if q is None else q[:s.req_k])
    fresh = [s for s in order if s.req_k and s.rid not in hit_ids]
    if fresh:
        d, q = drafter.propose(fresh)
        r = 0
        for s, ds in zip(fresh, d):
            out[s.rid] = (ds, None if q is None else q[r:r + len(ds)])
            r += len(ds)
    return out, len(hit_ids), stale


def _reply(link: Link, order: list[State], hashes: dict[int, int], out, hits: int, stale: int,
           corrupt: str = "") -> None:
    """DRAFTS: per request its base (length, hash) and drafts; q rows sparse when sampled
    with top-k/top-p. ``corrupt`` plants a malformed reply (fault injection for tests)."""
    rows = [out[s.rid][1] for s in order if out[s.rid][1] is not None]
    q = torch.cat(rows) if rows else None
    sparse = q is not None and any(s.req.top_k > 0 or s.req.top_p < 1 for s in order)
    idx, q = sparse_q(q) if sparse else (None, q)
    words, q, idx = encode(Drafts(hits, stale, [DraftEntry(s.rid, len(s.tokens), hashes[s.rid], out[s.rid][0])
                                                for s in order], q, idx))
    link.send(corrupted(words, corrupt) if corrupt else words, q, idx)


def _guess_next(order: list[State], out, drafter) -> Guess:
    """Draft the next round assuming every draft is accepted: the chain continues with one
    more token (the guessed bonus) and then the next round's drafts."""
    spec = [s for s in order if s.req_k]
    guess: Guess = {}
    if not spec:
        return guess
    base = {s.rid: s.tokens for s in spec}
    for s in spec:
        s.tokens, s.req_k = s.tokens + out[s.rid][0], s.req_k + 1
    d, q = drafter.propose(spec)
    r = 0
    for s, ds in zip(spec, d):
        if ds:
            guess[s.rid] = (s.tokens + ds[:1], ds[1:], None if q is None else q[r + 1:r + len(ds)])
        r += len(ds)
        s.tokens, s.req_k = base[s.rid], s.req_k - 1
    return guess
