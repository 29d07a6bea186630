"""The draft worker's side of the two-rank protocol: `draft_worker` answers each COMMIT
with DRAFTS built on exactly the committed prefix, and overlaps the target's verification
by drafting the next round ahead for the likeliest outcomes of the one being verified
(`hal.distributed.speculate`): a COMMIT whose outcome was among them is answered at once.
`serve_epochs` is the worker's life across epochs (`hal.distributed.rendezvous`): when the
target lost it, the worker drops every request and joins the next epoch."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hal.errors import HalError
from hal.host_threads import in_a_thread_that_ends
from hal.engine.history import HistoryBuffer
from hal.distributed.link import Link
from hal.distributed.protocol import (DRAFT_SEED, HASH_SEED, STOP, TARGET, Commit, DraftEntry, Drafts, Stop,
                                     Timing, corrupted, decode, encode, history_hash)
from hal.distributed.offers import Offers, wire_q
from hal.distributed.speculate import TOP, Drafted, FanOut
from hal.engine.drafting import DraftBatch, capabilities, pack_features
from hal.engine.requests import SamplingParams

FANOUT = 8   # branches drafted ahead per request and round (``--fanout``)


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
                 lock: threading.Lock | None = None, fanout: int | None = None, bounded: bool = True,
                 push: bool = False) -> None:
    """Serve DRAFTS for each COMMIT of ``epoch`` until STOP (see the module docstring); ``idle``:
    the longest wait for the next COMMIT, in seconds (None: the link's default). ``lock`` is
    held while the drafter works; once ``epoch`` is no longer current this returns untouched.
    ``fanout``: branches drafted ahead per request and round (`hal.distributed.speculate`; 0:
    none; None: `FANOUT`, or 0 for a drafter that reads the target's features; such a drafter
    drafts ahead only with ``own_features``); ``bounded`` False:
    the whole fan-out before the next message (tests: hits that do not depend on timing).
    ``push``: each wave's branches are also sent as OFFER while the target verifies (`hal.distributed.offers.Offers`),
    and a COMMIT that asks for no reply (the target took every request's drafts from them) gets
    none; the round is otherwise served exactly as one that does."""
    ep = epoch or Epoch()
    reqs, lock = ep.reqs, lock or contextlib.nullcontext()
    hist = HistoryBuffer("cpu")   # the committed tokens the drafter reads (drafters move them to their device)
    caps = capabilities(drafter)
    if fanout is None:   # a feature drafter drafts ahead (from its own features) only when asked
        fanout = FANOUT if caps.features is None else 0
    fan = FanOut(fanout if caps.features is None or caps.own_features else 0, bounded, caps.own_features)
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_receive, args=(link, inbox, idle), daemon=True, name=f"hal-recv-{ep.number}").start()
    replies, offers = 0, Offers(link, push, ep.number)
    while True:
        arrived, msg = _await(inbox, lambda: _ahead(fan, reqs, hist, drafter, lock, ep, inbox, offers),
                              lambda: offers.close(fan, ep.current, reqs))
        with lock:
            if not ep.current:
                return
            msg = decode(*msg)   # the target is another process too: checked
            if isinstance(msg, Stop):
                if push:   # the target's reader thread waits on the link: STOP ends it too
                    link.send(*encode(Stop()))
                    link.flush()
                ep.stopped = True   # last: the rank then destroys the group, which must not be mid-send
                return
            if not isinstance(msg, Commit) or msg.epoch != ep.number:
                raise HalError(f"hal.launch worker: expected COMMIT of epoch {ep.number} or STOP, got "
                               f"{type(msg).__name__}" + (f" of epoch {msg.epoch}" if isinstance(msg, Commit) else ""))
            order = _apply_commit(msg, reqs, hist, fan, drafter)
            offers.committed()
            out, hits, misses = _drafts_for(order, reqs, hist, fan, drafter)
            if fault and replies == int(fault.split(":")[1]):  # fault injection for tests: HAL_SERVE_FAULT=
                if fault.startswith("kill"):                   # kill:N (SIGKILL after N replies),
                    os.kill(os.getpid(), signal.SIGKILL)       # hang:N:S (stop answering for S s, then exit),
                if fault.startswith("hang"):                   # bad:N:KIND (reply N+1 malformed: KIND is
                    time.sleep(float(fault.split(":")[2]))     # kind, truncated, oov, negative or count)
                    os._exit(0)
            ahead = (0, 0) if push else (fan.branches, int(1e6 * fan.ahead_s))   # pushed: the final OFFER told
            timing = Timing(*ahead, int(1e6 * (time.perf_counter() - arrived)))
            if msg.reply:
                _reply(link, order, reqs, out, hits, misses, timing,
                       fault.split(":")[2] if fault.startswith("bad") and replies == int(fault.split(":")[1]) else "",
                       ep.number)
            replies += 1
            fan.replied_now(arrived)
            for rid in order:   # round r+1 draws after round r's drafts and the extension's guess
                r = reqs[rid]
                r.offset += r.k + 1 if r.k else 0
                if r.k:
                    fan.plan(rid, r.tokens, out[rid])


def _receive(link: Link, inbox: queue.Queue, idle: float | None) -> None:
    """The link's reader (its own thread, so the drafter can work while no message is due):
    each message with its arrival time, or the link's failure, into ``inbox``."""
    while True:
        try:
            got = link.recv(idle)
        except BaseException as e:   # the link failed or timed out: the loop raises it
            inbox.put((time.perf_counter(), e))
            return
        inbox.put((time.perf_counter(), got))
        if got[0][:1] == [STOP]:
            return


def _await(inbox: queue.Queue, ahead, done) -> tuple[float, tuple]:
    """The next message and its arrival time; first ``ahead()`` drafts waves until it returns
    False (nothing more worth drafting, or a message has arrived), then ``done()``."""
    while ahead():
        pass
    done()
    arrived, got = inbox.get()
    if isinstance(got, BaseException):
        raise got
    return arrived, got


def _ahead(fan: FanOut, reqs: dict[int, _Req], hist: HistoryBuffer, drafter, lock, ep: Epoch,
           inbox: queue.Queue, offers: Offers) -> bool:
    """One wave of the fan-out (`hal.distributed.speculate`): one branch per request, regular
    branches in one drafter call and extensions (one slot more, from the guess's offset) in
    another. False when nothing is left, the window is spent, or the epoch is over."""
    with lock:
        wave = fan.next_wave() if ep.current and fan.fits(not inbox.empty()) else []
        if not wave:
            return False
        t0, got = time.perf_counter(), {}
        for extra in (0, 1):
            group = [b for b in wave if b.extend == bool(extra)]
            if group:
                rids = [b.rid for b in group]
                res = _propose(drafter, reqs, hist, rids, [reqs[r].k + extra for r in rids], [b.base for b in group],
                               [reqs[r].offset - extra for r in rids], TOP + 1,
                               [b.own for b in group] if fan.own_features else None)
                got.update(zip(map(id, group), res))
        offers.wave(fan.store(wave, [got[id(b)] for b in wave], time.perf_counter() - t0), reqs)
        return True


def serve_epochs(rv, drafter, device: torch.device, fault: str = "", idle: float = 600.0,
                 join_timeout: float = 10.0, fanout: int | None = None, push: bool = False) -> None:
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
        thread = threading.Thread(target=_serve, args=(link, drafter, fault if e == 0 else "", idle, ep, lock, failed,
                                                       fanout, push),
                                  daemon=True, name=f"hal-draft-epoch-{e}")
        thread.start()
    thread.join(join_timeout)   # stopped: its last act; the group is destroyed only after it


def _serve(link, drafter, fault, idle, ep: Epoch, lock, failed: list, fanout: int, push: bool) -> None:
    try:
        with torch.inference_mode():   # thread-local: drafting never records autograd (as the target's step)
            draft_worker(link, drafter, fault, idle, ep, lock, fanout, push=push)
    except RuntimeError as e:   # the link: reset or timed out; the target announces the next epoch
        if ep.current:
            print(f"hal.launch worker: epoch {ep.number} lost ({str(e).splitlines()[0][:120]}); "
                  "waiting for the next", file=sys.stderr, flush=True)
    except HalError as e:
        if ep.current:
            failed.append(e)


def _apply_commit(msg: Commit, reqs: dict[int, _Req], hist: HistoryBuffer, fan: FanOut, drafter) -> list[int]:
    """Extend each request's committed history (new requests arrive with their sampling
    parameters; finished ones are released) and tell the fan-out what was committed. Returns
    the requests of this round, in order."""
    for rid in msg.finished:
        if reqs.pop(rid, None) is not None:
            drafter.release(rid)
            hist.release(rid)
        fan.drop(rid)
    order = []
    for e in msg.entries:
        if e.new is not None:
            n = e.new
            reqs[e.rid] = _Req(SamplingParams(max_new_tokens=n.max_new_tokens, temperature=n.temperature,
                                              top_k=n.top_k, top_p=n.top_p, seed=n.seed + DRAFT_SEED))
            hist.release(e.rid)
            hist.add(e.rid, [])
            fan.drop(e.rid)
        if e.rid not in reqs:
            raise HalError(f"hal.launch worker: expected a known request or its parameters, got request {e.rid}")
        r = reqs[e.rid]
        if len(r.tokens) + len(e.delta) != e.length:
            raise HalError(f"hal.launch: expected a committed history of {e.length} tokens for request {e.rid}, "
                           f"got {len(r.tokens) + len(e.delta)} (protocol out of step)")
        if e.delta:
            hist.write([e.rid], [len(r.tokens)], torch.tensor([e.delta], dtype=torch.long))
        fan.observe(e.rid, r.tokens, e.delta)
        r.tokens = r.tokens + e.delta
        r.hash = history_hash(e.delta, r.hash)
        if e.features is not None:
            r.features.append(e.features)
        r.k = e.k
        order.append(e.rid)
    return order
def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _propose(drafter, reqs: dict[int, _Req], hist: HistoryBuffer, rids: list[int], ks: list[int],
             bases: list[list[int]], offsets: list[int], alternatives: int = 0,
             own: list[Tensor] | None = None) -> list[Drafted]:
    """Run the drafter on ``bases`` (each the committed history, or a branch of it whose
    uncommitted tail is written after it as scratch; ``own``: a feature drafter's own features
    for each tail, one row per tail token), drawing from ``offsets``. The drafter is first told
    how much of what it last drafted each base keeps (`Drafter.commit`)."""
    for rid, base in zip(rids, bases):
        tail = base[len(reqs[rid].tokens):]
        if tail:
            hist.write([rid], [len(reqs[rid].tokens)], torch.tensor([tail], dtype=torch.long))
    kept = [(rid, _common_prefix(reqs[rid].last, base)) for rid, base in zip(rids, bases) if reqs[rid].last is not None]
    if kept:
        drafter.commit([rid for rid, _ in kept], [n for _, n in kept])
    lens = [len(b) for b in bases]
    features, num_features = pack_features([reqs[r].features for r in rids])
    tails = [len(b) - len(reqs[r].tokens) for r, b in zip(rids, bases)]
    if own is not None and any(t and (g is None or len(g) != t) for g, t in zip(own, tails)):
        raise HalError(f"hal.launch worker: expected own features for each branch's {tails} tail tokens, got "
                       f"{[None if g is None else len(g) for g in own]}")
    guesses = None if own is None or not any(tails) else torch.cat([g for g, t in zip(own, tails) if t])
    batch = DraftBatch(rids=tuple(rids), params=tuple(reqs[r].params for r in rids), history=hist.view(rids, max(lens)),
                       num_tokens=torch.tensor(lens), lengths=tuple(lens), k=tuple(ks), offsets=tuple(offsets),
                       features=features, num_features=num_features, alternatives=alternatives,
                       own_features=guesses, num_own=tuple(tails) if guesses is not None else ())
    prop = drafter.propose(batch)
    for r in rids:
        reqs[r].features = []   # passed once
    return [_drafted(reqs[rid], base, got) for rid, base, got in zip(rids, bases, _split(prop, ks))]


def _split(prop, ks: list[int]) -> list[Drafted]:
    """A `Proposal` as host `Drafted` per request (its valid slots only)."""
    ids = prop.draft_token_ids.cpu().tolist()
    par = None if prop.parent_ids is None else prop.parent_ids.cpu().tolist()
    valid = ks if prop.num_valid is None else [int(v) for v in prop.num_valid.cpu().tolist()]
    q = None if prop.draft_probs is None else prop.draft_probs.cpu()
    top = None if prop.top_ids is None else list(zip(prop.top_ids.cpu().tolist(), prop.top_probs.cpu().tolist()))
    own = None if prop.own_features is None else prop.own_features.cpu()
    out, c = [], 0
    for k, n in zip(ks, valid):
        alts = None if top is None else [list(zip(*top[j])) for j in range(c, c + n)]
        out.append(Drafted(ids[c:c + n], None if q is None else q[c:c + n], alts, None if par is None else par[c:c + n],
                           None if own is None else own[c:c + n]))
        c += k
    return out


def _drafted(r: _Req, base: list[int], got: Drafted) -> Drafted:
    r.last = base + got.drafts if got.parents is None else base   # a tree's slots are not a continuation
    return got


def _drafts_for(order: list[int], reqs: dict[int, _Req], hist: HistoryBuffer, fan: FanOut, drafter):
    """Each request's drafts for this round: from the speculation cache where its outcome was
    drafted ahead, else fresh. Returns them, the cache hits and the misses."""
    out: dict[int, Drafted] = {}
    misses = 0
    for rid in order:
        r = reqs[rid]
        got, planned = fan.lookup(rid, len(r.tokens), r.hash, r.k)
        if got is not None:
            out[rid] = got
        misses += planned and got is None and r.k > 0
    hits = len(out)
    # a feature drafter (an EAGLE head) is passed every request's new features, drafting or not
    fresh = [rid for rid in order if (reqs[rid].k or reqs[rid].features) and rid not in out]
    if fresh:
        got = _propose(drafter, reqs, hist, fresh, [reqs[r].k for r in fresh], [reqs[r].tokens for r in fresh],
                       [reqs[r].offset for r in fresh], TOP + 1 if fan.budget else 0)
        out.update(zip(fresh, got))
    for rid in order:
        out.setdefault(rid, Drafted([]))
    return out, hits, misses


def _reply(link: Link, order: list[int], reqs: dict[int, _Req], out: dict[int, Drafted], hits: int, misses: int,
           timing: Timing, corrupt: str = "", epoch: int = 0) -> None:
    """DRAFTS: per request its base (length, hash) and drafts; q rows sparse when sampled
    with top-k/top-p. ``corrupt`` plants a malformed reply (fault injection for tests)."""
    idx, q = wire_q([out[rid].q for rid in order if out[rid].q is not None and out[rid].drafts],
                    [reqs[r].params for r in order])
    entries = [DraftEntry(rid, len(reqs[rid].tokens), reqs[rid].hash, out[rid].drafts, out[rid].parents)
               for rid in order]
    words, q, idx = encode(Drafts(hits, misses, entries, q, idx, epoch, timing))
    link.send(corrupted(words, corrupt) if corrupt else words, q, idx)


def serve_draft_rank(rv, drafter, device: torch.device, *, hidden: int, k: int, draft_timeout: float,
                     join_timeout: float, fanout: int | None = None, push: bool = False) -> None:
    """The draft rank under torchrun, its drafter loaded (`hal.launch.start`): warm the drafter
    up, then serve drafts epoch by epoch (`serve_epochs`) until the target stops. SIGTERM
    (torchrun forwards its own) ends it with exit 0."""
    import torch.distributed as dist
    signal.signal(signal.SIGTERM, _quiet_exit)
    if drafter is not None:   # its first call pays for the kernels' set-up (~1 s): not in the first round
        from hal.engine.costs import profile_drafter
        # in a thread that ends: the epochs' threads draft, and no OpenMP team stays on this one
        in_a_thread_that_ends(lambda: profile_drafter(drafter, device, hidden, reps=1, points=(1, max(1, k))))
    try:
        serve_epochs(rv, drafter, device, os.environ.get("HAL_SERVE_FAULT", ""),
                     idle=max(600.0, draft_timeout), join_timeout=join_timeout, fanout=fanout, push=push)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _quiet_exit(signum, frame) -> None:
    """SIGTERM on the draft rank: exit 0 now. It holds nothing to flush, and unwinding past a
    live gloo thread would end in std::terminate."""
    print("hal.launch worker: SIGTERM; stopping", file=sys.stderr, flush=True)
    os._exit(0)
