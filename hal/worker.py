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
from hal.protocol import DRAFT_SEED, DRAFTS, HASH_SEED, STOP, Link, corrupted, history_hash

Guess = dict[int, tuple[list[int], list[int], Tensor | None]]  # rid -> (assumed history, drafts, q rows)


def draft_worker(link: Link, drafter, fault: str = "", idle: float | None = None) -> None:
    """Serve DRAFTS for each COMMIT until STOP (see the module docstring); ``idle``: the
    longest wait for the next COMMIT, in seconds (None: the link's default)."""
    states: dict[int, State] = {}
    hashes: dict[int, int] = {}  # rid -> history_hash of its committed history
    guess: Guess = {}
    replies = 0
    while True:
        words, floats, _ = link.recv(idle)
        if words[0] == STOP:
            return
        order = _apply_commit(words, floats, states, hashes, guess, drafter)
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


def _apply_commit(words: list[int], floats, states: dict[int, State], hashes: dict[int, int], guess: Guess,
                  drafter) -> list[State]:
    """Extend each request's committed history (new requests arrive with their sampling
    parameters; finished ones are released). Returns the requests of this round, in order."""
    n, n_done = words[1], words[2]
    for rid in words[3:3 + n_done]:
        if (st := states.pop(rid, None)) is not None:
            drafter.release(st)
        guess.pop(rid, None)
        hashes.pop(rid, None)
    at, f, order = 3 + n_done, 0, []
    for _ in range(n):
        rid, k, length, new = words[at:at + 4]
        at += 4
        if new:
            top_k, seed, max_new = words[at:at + 3]
            at += 3
            temp, top_p = floats[f].tolist()
            f += 1
            req = Request([0], max_new_tokens=max_new, temperature=temp, top_k=top_k, top_p=top_p,
                          seed=seed + DRAFT_SEED, k=k)
            states[rid] = State(req, rid, [], seq=None)
        st, nd = states[rid], words[at]
        st.tokens = st.tokens + words[at + 1:at + 1 + nd]
        hashes[rid] = history_hash(words[at + 1:at + 1 + nd], hashes.get(rid, HASH_SEED))
        at += 1 + nd
        if len(st.tokens) != length:
            raise HalError(f"hal.serve: expected a committed history of {length} tokens for request {rid}, "
                           f"got {len(st.tokens)} (protocol out of step)")
        st.req_k = k
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
    words, rows = [DRAFTS, hits, stale], []
    for s in order:
        ds, q = out[s.rid]
        words += [s.rid, len(s.tokens), hashes[s.rid], len(ds), *ds]
        if q is not None:
            rows.append(q)
    q = torch.cat(rows) if rows else None
    sparse = q is not None and any(s.req.top_k > 0 or s.req.top_p < 1 for s in order)
    idx, q = sparse_q(q) if sparse else (None, q)
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
