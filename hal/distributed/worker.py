"""The draft worker's side of the two-rank protocol: `draft_worker` answers each COMMIT
with DRAFTS built on exactly the committed prefix, and overlaps the target's verification
by drafting the next round on "all accepted + its own guess of the bonus token".
`serve_epochs` is the worker's life across epochs (`hal.distributed.rendezvous`): when the
target lost it, the worker drops every request and joins the next epoch."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hal.errors import HalError
from hal.engine.history import HistoryBuffer
from hal.devices import sparse_q
from hal.distributed.protocol import (DRAFT_SEED, HASH_SEED, TARGET, Commit, DraftEntry, Drafts, Link, Stop, corrupted,
                                     decode, encode, history_hash)
from hal.engine.drafting import DraftBatch, capabilities, pack_features
from hal.engine.requests import SamplingParams

Guess = dict[int, tuple[list[int], list[int], Tensor | None]]  # rid -> (assumed history, drafts, q rows)


@dataclass
class _Req:
    """What the worker keeps per request: its parameters and committed tokens (host), the
    hash of those, its Philox offset, and what the drafter last drafted (base + drafts)."""

    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    hash: int = HASH_SEED
    k: int = 0
    offset: int = 0
    last: list[int] | None = None
    features: list[Tensor] = field(default_factory=list)   # the target's features not yet given to the drafter


@dataclass
class Epoch:
    """One epoch's serving state: its number, its requests, and whether it is still the
    current one (an old epoch's thread must not touch the drafter again)."""

    number: int = 0
    reqs: dict[int, _Req] = field(default_factory=dict)
    current: bool = True
    stopped: bool = False


def draft_worker(link: Link, drafter, fault: str = "", idle: float | None = None, epoch: Epoch | None = None,
                 lock: threading.Lock | None = None) -> None:
    """Serve DRAFTS for each COMMIT of ``epoch`` until STOP (see the module docstring); ``idle``:
    the longest wait for the next COMMIT, in seconds (None: the link's default). ``lock`` is
    held while the drafter works; once ``epoch`` is no longer current this returns untouched."""
    ep = epoch or Epoch()
    reqs, lock = ep.reqs, lock or contextlib.nullcontext()
    hist = HistoryBuffer("cpu")   # the committed tokens the drafter reads (drafters move them to their device)
    guess: Guess = {}
    replies = 0
    while True:
        msg = decode(*link.recv(idle))   # the target is another process too: checked
        with lock:
            if not ep.current:
                return
            if isinstance(msg, Stop):
                ep.stopped = True
                return
            if not isinstance(msg, Commit) or msg.epoch != ep.number:
                raise HalError(f"hal.launch worker: expected COMMIT of epoch {ep.number} or STOP, got "
                               f"{type(msg).__name__}" + (f" of epoch {msg.epoch}" if isinstance(msg, Commit) else ""))
            order = _apply_commit(msg, reqs, hist, guess, drafter)
            out, hits, stale = _drafts_for(order, reqs, hist, guess, drafter)
            if fault and replies == int(fault.split(":")[1]):  # fault injection for tests: HAL_SERVE_FAULT=
                if fault.startswith("kill"):                   # kill:N (SIGKILL after N replies),
                    os.kill(os.getpid(), signal.SIGKILL)       # hang:N:S (stop answering for S s, then exit),
                if fault.startswith("hang"):                   # bad:N:KIND (reply N+1 malformed: KIND is
                    time.sleep(float(fault.split(":")[2]))     # kind, truncated, oov, negative or count)
                    os._exit(0)
            _reply(link, order, reqs, out, hits, stale,
                   fault.split(":")[2] if fault.startswith("bad") and replies == int(fault.split(":")[1]) else "",
                   ep.number)
            replies += 1
            guess = _guess_next(order, reqs, hist, out, drafter)  # overlaps the target's verification


def serve_epochs(rv, drafter, device: torch.device, fault: str = "", idle: float = 600.0,
                 join_timeout: float = 10.0) -> None:
    """The worker's life (`hal.distributed.rendezvous`): join the newest epoch and serve it
    (`draft_worker`, in a thread); when the target announces a newer epoch (it lost this
    worker), drop every request of the old one and join the new. The first meeting waits for
    the target to be ready (it announces epoch 0 after its plan and load) up to ``idle`` s.
    Returns at STOP; raises `HalError` when the target is gone, unreachable or not ready for
    ``idle`` s, or sent a bad message."""
    lock, ep, thread, failed = threading.Lock(), None, None, []
    contact = start = time.monotonic()
    while not (ep is not None and ep.stopped):
        if failed:
            raise failed[0]
        try:
            e = rv.newest(0 if ep is None else ep.number + 1, timeout=1.0)
        except HalError:   # the target is gone: after its STOP that is the end, else a failure
            if ep is not None and ep.stopped:
                return
            raise
        now = time.monotonic()
        if e is None:   # the store is out of reach (the link is down, or the target is stopped)
            if now - contact > idle:
                raise HalError(f"the target: expected it reachable, got no answer for {idle} s")
            continue
        contact = now
        if e < 0:   # the target is still loading
            if now - start > idle:
                raise HalError(f"the target: expected it ready to meet within {idle} s, got no epoch announced")
            continue
        if ep is not None and e <= ep.number:
            continue
        with lock:   # the target dropped the old epoch: so does this worker
            if ep is not None:
                ep.current = False
                for rid in ep.reqs:
                    drafter.release(rid)
        rv.join(e)
        ep = Epoch(e)
        try:
            group = rv.group(e, join_timeout)
        except HalError as err:   # the target gave up on this epoch: it announces the next
            print(f"hal.launch worker: {err}", file=sys.stderr, flush=True)
            ep.current = False
            continue
        print(f"hal.launch worker: joined epoch {e}", file=sys.stderr, flush=True)
        gloo = rv.backend_of(e) == "gloo"
        link = Link(TARGET, torch.device("cpu") if gloo else device, group, framed=gloo)
        thread = threading.Thread(target=_serve, args=(link, drafter, fault if e == 0 else "", idle, ep, lock, failed),
                                  daemon=True, name=f"hal-draft-epoch-{e}")
        thread.start()


def _serve(link, drafter, fault, idle, ep: Epoch, lock, failed: list) -> None:
    try:
        draft_worker(link, drafter, fault, idle, ep, lock)
    except RuntimeError as e:   # the link: reset or timed out; the target announces the next epoch
        if ep.current:
            print(f"hal.launch worker: epoch {ep.number} lost ({str(e).splitlines()[0][:120]}); "
                  "waiting for the next", file=sys.stderr, flush=True)
    except HalError as e:
        if ep.current:
            failed.append(e)


def _apply_commit(msg: Commit, reqs: dict[int, _Req], hist: HistoryBuffer, guess: Guess, drafter) -> list[int]:
    """Extend each request's committed history (new requests arrive with their sampling
    parameters; finished ones are released) and tell the drafter what of its last drafts
    became history. Returns the requests of this round, in order."""
    for rid in msg.finished:
        if reqs.pop(rid, None) is not None:
            drafter.release(rid)
            hist.release(rid)
        guess.pop(rid, None)
    order, kept = [], []
    for e in msg.entries:
        if e.new is not None:
            n = e.new
            reqs[e.rid] = _Req(SamplingParams(max_new_tokens=n.max_new_tokens, temperature=n.temperature,
                                              top_k=n.top_k, top_p=n.top_p, seed=n.seed + DRAFT_SEED))
            hist.release(e.rid)
            hist.add(e.rid, [])
        if e.rid not in reqs:
            raise HalError(f"hal.launch worker: expected a known request or its parameters, got request {e.rid}")
        r = reqs[e.rid]
        if len(r.tokens) + len(e.delta) != e.length:
            raise HalError(f"hal.launch: expected a committed history of {e.length} tokens for request {e.rid}, "
                           f"got {len(r.tokens) + len(e.delta)} (protocol out of step)")
        if e.delta:
            hist.write([e.rid], [len(r.tokens)], torch.tensor([e.delta], dtype=torch.long))
        r.tokens = r.tokens + e.delta
        r.hash = history_hash(e.delta, r.hash)
        if e.features is not None:
            r.features.append(e.features)
        r.k = e.k
        if r.last is not None:
            kept.append((e.rid, _common_prefix(r.last, r.tokens)))
            r.last = None
        order.append(e.rid)
    if kept:
        drafter.commit([rid for rid, _ in kept], [n for _, n in kept])
    return order


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _propose(drafter, reqs: dict[int, _Req], hist: HistoryBuffer, rids: list[int], ks: list[int],
             bases: list[list[int]]) -> list[tuple[list[int], Tensor | None, list[int] | None]]:
    """Run the drafter on ``bases`` (the histories, already in ``hist``): host drafts, q rows
    and a tree's parents."""
    lens = [len(b) for b in bases]
    features, num_features = pack_features([reqs[r].features for r in rids])
    batch = DraftBatch(rids=tuple(rids), params=tuple(reqs[r].params for r in rids), history=hist.view(rids, max(lens)),
                       num_tokens=torch.tensor(lens), lengths=tuple(lens), k=tuple(ks),
                       offsets=tuple(reqs[r].offset for r in rids), features=features, num_features=num_features)
    prop = drafter.propose(batch)
    for r in rids:
        reqs[r].features = []   # passed once
    ids = prop.draft_token_ids.cpu().tolist()
    par = None if prop.parent_ids is None else prop.parent_ids.cpu().tolist()
    valid = ks if prop.num_valid is None else [int(v) for v in prop.num_valid.cpu().tolist()]
    q = None if prop.draft_probs is None else prop.draft_probs.cpu()
    out, c = [], 0
    for rid, k, n, base in zip(rids, ks, valid, bases):
        d = ids[c:c + n]
        out.append((d, None if q is None else q[c:c + n], None if par is None else par[c:c + n]))
        reqs[rid].offset += k
        reqs[rid].last = base + d if par is None else base   # a tree's slots are not a continuation
        c += k
    return out


def _drafts_for(order: list[int], reqs: dict[int, _Req], hist: HistoryBuffer, guess: Guess, drafter):
    """Each request's drafts (and q rows): the overlap guess where it holds (the target
    accepted everything and its bonus token was the draft's guess), else fresh ones."""
    hit_ids = {rid for rid in order if reqs[rid].k and rid in guess and guess[rid][0] == reqs[rid].tokens
               and len(guess[rid][1]) >= reqs[rid].k}
    stale = sum(1 for rid in order if rid in guess and rid not in hit_ids)
    out: dict[int, tuple[list[int], Tensor | None, list[int] | None]] = {rid: ([], None, None) for rid in order}
    for rid in hit_ids:
        _, d, q = guess[rid]
        k = reqs[rid].k
        out[rid] = (d[:k], None if q is None else q[:k], None)
    # a feature drafter (an EAGLE head) is passed every request's new features, drafting or not
    fresh = [rid for rid in order if (reqs[rid].k or reqs[rid].features) and rid not in hit_ids]
    if fresh:
        got = _propose(drafter, reqs, hist, fresh, [reqs[r].k for r in fresh], [reqs[r].tokens for r in fresh])
        out.update(zip(fresh, got))
    return out, len(hit_ids), stale


def _reply(link: Link, order: list[int], reqs: dict[int, _Req], out, hits: int, stale: int,
           corrupt: str = "", epoch: int = 0) -> None:
    """DRAFTS: per request its base (length, hash) and drafts; q rows sparse when sampled
    with top-k/top-p. ``corrupt`` plants a malformed reply (fault injection for tests)."""
    rows = [out[rid][1] for rid in order if out[rid][1] is not None]
    q = torch.cat(rows) if rows else None
    sparse = q is not None and any(reqs[r].params.top_k > 0 or reqs[r].params.top_p < 1 for r in order)
    idx, q = sparse_q(q) if sparse else (None, q)
    words, q, idx = encode(Drafts(hits, stale, [DraftEntry(rid, len(reqs[rid].tokens), reqs[rid].hash, out[rid][0],
                                                           out[rid][2]) for rid in order], q, idx, epoch))
    link.send(corrupted(words, corrupt) if corrupt else words, q, idx)


def _guess_next(order: list[int], reqs: dict[int, _Req], hist: HistoryBuffer, out, drafter) -> Guess:
    """Draft the next round assuming every draft is accepted: the chain continues with one
    more token (the guessed bonus) and then the next round's drafts."""
    spec = [rid for rid in order if reqs[rid].k]
    if not spec or capabilities(drafter).features is not None:   # no features for guessed tokens
        return {}
    if any(out[rid][2] is not None for rid in spec):   # a tree has no single continuation to guess from
        return {}
    bases = [reqs[rid].tokens + out[rid][0] for rid in spec]
    for rid in spec:   # the drafts sit after the committed tokens (scratch until the next COMMIT)
        if out[rid][0]:
            hist.write([rid], [len(reqs[rid].tokens)], torch.tensor([out[rid][0]], dtype=torch.long))
    drafter.commit(spec, [len(b) for b in bases])   # assume all drafts accepted
    got = _propose(drafter, reqs, hist, spec, [reqs[rid].k + 1 for rid in spec], bases)
    guess: Guess = {}
    for rid, base, (d, q, _) in zip(spec, bases, got):
        if d:
            guess[rid] = (base + d[:1], d[1:], None if q is None else q[1:])
    return guess


def serve_draft_rank(rv, drafter, device: torch.device, *, hidden: int, k: int, draft_timeout: float,
                     join_timeout: float) -> None:
    """The draft rank under torchrun, its drafter loaded (`hal.launch.start`): warm the drafter
    up, then serve drafts epoch by epoch (`serve_epochs`) until the target stops. SIGTERM
    (torchrun forwards its own) ends it with exit 0."""
    import torch.distributed as dist
    signal.signal(signal.SIGTERM, _quiet_exit)
    if drafter is not None:   # its first call pays for the kernels' set-up (~1 s): not in the first round
        from hal.engine.router import profile_drafter
        profile_drafter(drafter, device, hidden, reps=1, points=(1, max(1, k)))
    try:
        serve_epochs(rv, drafter, device, os.environ.get("HAL_SERVE_FAULT", ""),
                     idle=max(600.0, draft_timeout), join_timeout=join_timeout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _quiet_exit(signum, frame) -> None:
    """SIGTERM on the draft rank: exit 0 now. It holds nothing to flush, and unwinding past a
    live gloo thread would end in std::terminate."""
    print("hal.launch worker: SIGTERM; stopping", file=sys.stderr, flush=True)
    os._exit(0)
