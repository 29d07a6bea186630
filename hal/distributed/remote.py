"""The target's side of the two-rank protocol: `RemoteDrafter`, a `hal.engine.decoder.Drafter`
whose drafts come from the draft worker over a `hal.distributed.link.Link`. It trusts nothing the
worker sends; a dead, silent or malformed worker leaves plain decoding (counted). A worker
lost to the link (a reset or a timeout) may rejoin by the next epoch (`hal.distributed.rendezvous`):
then every live request is sent afresh and drafting resumes."""

from __future__ import annotations

import queue
import sys
import threading
import time

import torch
from torch import Tensor

from hal.engine import trees
from hal.checks import MAX_K, prob_values
from hal.engine.drafting import DraftBatch, Proposal
from hal.errors import HalError
from hal.devices import dense_q, transfer
from hal.distributed.link import Link
from hal.distributed.protocol import (DRAFT, HASH_SEED, STOP, Commit, CommitEntry, Drafts, NewRequest, Offer, Stop,
                                     decode, encode, history_hash)

MAX_OFFERED = 4096   # branches the target keeps from one round's offers (the worker is untrusted)
MAX_WAITING = 256    # messages the offers' reader holds before it stops reading (the worker then waits)

class RemoteDrafter:
    """The target's view of the draft worker (a `hal.engine.decoder.Drafter`). ``push``: the
    worker also offers the branches it drafts ahead while the target verifies (OFFER, read by a
    thread of this link); a round whose every request's history was offered takes its drafts
    from them and asks for no reply, so it waits for neither the link nor the worker.
    ``wait_offers`` (tests): wait for the worker's last offer of the round before choosing."""

    kind = "remote"   # the per-drafter metrics' label: the method runs on the draft rank

    def __init__(self, link: Link | None, vocab: int, device: torch.device, metrics, timeout: float = 30.0,
                 first_timeout: float = 60.0, features: tuple[int, ...] | None = None, rendezvous=None,
                 epoch: int = 0, push: bool = False, wait_offers: bool = False):
        self.link, self.vocab, self.device, self.metrics = link, vocab, device, metrics
        self.rendezvous, self.epoch, self._asked = rendezvous, epoch, 0.0   # rejoin (None: never)
        if features is not None:   # the worker runs an EAGLE head: send it the target's features
            self.features = tuple(features)
        self.timeout, self.first_timeout = timeout, first_timeout
        self.sent: dict[int, int] = {}     # rid -> tokens of its history the worker has
        self.hashes: dict[int, int] = {}   # rid -> history_hash of those tokens
        self.finished: list[int] = []
        self.alive, self.lost, self.rounds, self.cache_hits, self.cache_misses = link is not None, False, 0, 0, 0
        self.wait_s = 0.0   # seconds the target spent in a round (send, the worker's drafting, receive)
        self._bytes = [0, 0]   # sent, received over the links of earlier epochs
        self.push, self.wait_offers, self.pushed_rounds = push, wait_offers, 0
        self.commits = 0       # COMMITs sent on this link: an offer names the one it followed
        self._inbox: queue.Queue | None = None
        if link is not None:
            self._listen()
        if link is None and rendezvous is not None:   # nobody joined ``epoch``: open the next for a late worker
            self.lost, self.epoch = True, epoch + 1
            rendezvous.announce(self.epoch)

    @property
    def bytes_sent(self) -> int:
        return self._bytes[0] + (self.link.bytes_sent if self.link is not None else 0)

    @property
    def bytes_received(self) -> int:
        return self._bytes[1] + (self.link.bytes_received if self.link is not None else 0)

    def propose(self, b: DraftBatch) -> Proposal:
        R = len(b.rids)
        if not self.alive and not self._rejoin():
            return self._proposal(b, [[] for _ in range(R)], None)
        try:
            offered = self._offers() if self.push else {}
        except (RuntimeError, HalError) as e:   # the link failed, or an offer was malformed
            self._fail(e, lost=isinstance(e, RuntimeError))
            return self._proposal(b, [[] for _ in range(R)], None)
        msg = self._commit(b)
        picked = self._pick(b, offered) if offered else None
        msg.reply = picked is None
        try:
            t0 = time.perf_counter()
            self.link.send(*encode(msg)[:2])
            self.commits += 1
            reply = self._reply() if msg.reply else None
            self.wait_s += time.perf_counter() - t0
        except RuntimeError as e:  # gloo: connection reset (the worker died) or a timeout
            self._fail(e, lost=True)
            return self._proposal(b, [[] for _ in range(R)], None)
        except HalError as e:      # a header out of bounds, or a message that is no reply
            self._fail(e)
            return self._proposal(b, [[] for _ in range(R)], None)
        self.rounds += 1
        try:
            if picked is not None:
                return self._proposal(b, *self._offered(b, picked))
            return self._proposal(b, *self._accept(b, reply))
        except HalError as e:      # the reply is not a valid DRAFTS message: plain decoding from here
            self._fail(e)
            return self._proposal(b, [[] for _ in range(R)], None)

    def _commit(self, b: DraftBatch) -> Commit:
        """This round's COMMIT: finished requests, then per request its newly committed tokens
        (and features, and parameters when new); the committed history's hash is kept."""
        live = set(b.rids)
        self.finished += [rid for rid in self.sent if rid not in live]
        for rid in self.finished:
            self.sent.pop(rid, None)
            self.hashes.pop(rid, None)
        msg, self.finished = Commit([], self.finished, self.epoch), []
        hist = transfer(b.history, torch.device("cpu"))   # the link carries host tensors
        feats = None if b.features is None else transfer(b.features, torch.device("cpu")).float()
        at = 0
        for i, (rid, p, L, k) in enumerate(zip(b.rids, b.params, b.lengths, b.k)):
            new = None if rid in self.sent else NewRequest(p.top_k, p.seed, p.max_new_tokens, p.temperature, p.top_p)
            delta = hist[i, self.sent.get(rid, 0):L].tolist()
            n = b.num_features[i] if b.num_features else 0
            msg.entries.append(CommitEntry(rid, k, L, delta, new, feats[at:at + n] if n else None))
            at += n
            self.sent[rid] = L
            self.hashes[rid] = history_hash(delta, self.hashes.get(rid, HASH_SEED))
        return msg

    def _recv(self, timeout: float):
        """The link's next message (``push``: from its reader thread's queue)."""
        if self._inbox is None:
            return self.link.recv(timeout)
        try:
            got = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"Timed out: no message from the draft worker within {timeout} s") from None
        if isinstance(got, BaseException):
            raise got
        return got

    def _reply(self) -> Drafts:
        """The worker's DRAFTS for the COMMIT just sent; offers still on their way are passed."""
        while True:
            msg = decode(*self._recv(self.timeout if self.rounds else self.first_timeout),
                         vocab=self.vocab, max_k=MAX_K)
            if not isinstance(msg, Offer):
                return msg
            self._offer_timing(msg)

    def _listen(self) -> None:
        """``push``: a thread reads this link into a queue of its own (offers arrive unasked)."""
        if not self.push:
            return
        inbox, link = queue.Queue(MAX_WAITING), self.link
        self._inbox = inbox

        def read():   # until the worker's STOP (its answer to ours) or the link's failure
            while True:
                try:
                    got = link.recv(None)
                except BaseException as e:   # the link failed: the next receive raises it
                    inbox.put(e)
                    return
                inbox.put(got)
                if got[0][:1] == [STOP]:
                    return
        self._reader = threading.Thread(target=read, daemon=True, name=f"hal-offers-{self.epoch}")
        self._reader.start()

    def _offers(self) -> dict[tuple[int, int, int], tuple[list[int], Tensor | None, Tensor | None]]:
        """The branches the worker offered after the last COMMIT, by (request, length, hash):
        their drafts and q rows (sparse: with indices). The messages waiting are read (at most
        `MAX_WAITING`: any later are stale by the next round); none may be a reply (none is due).
        ``wait_offers``: first the round's final offer."""
        out, waited = {}, not (self.wait_offers and self.rounds)
        for _ in range(MAX_WAITING):
            try:
                got = self._inbox.get_nowait() if waited else self._inbox.get(timeout=self.timeout)
            except queue.Empty:
                if waited:
                    return out
                raise RuntimeError(f"no final offer from the draft worker within {self.timeout} s") from None
            if isinstance(got, BaseException):
                raise got
            msg = decode(*got, vocab=self.vocab, max_k=MAX_K)
            if not isinstance(msg, Offer):
                raise HalError(f"draft worker message between rounds: expected OFFER, got {type(msg).__name__}")
            self._offer_timing(msg)
            if msg.epoch != self.epoch or msg.seq != self.commits:   # another round's: stale
                continue
            waited = waited or msg.final
            r = 0
            for e in msg.entries:
                n = len(e.tokens)
                if len(out) < MAX_OFFERED:
                    rows, idx = (None if t is None else t[r:r + n] for t in (msg.q, msg.idx))
                    out[(e.rid, e.base_len, e.base_hash)] = (e.tokens, rows, idx)
                r += n
        return out

    def _offer_timing(self, msg: Offer) -> None:
        if msg.final and msg.epoch == self.epoch:   # the round's drafting ahead, as a reply tells it otherwise
            self.metrics.fanout_branches += msg.timing.branches
            self.metrics.draft_ahead_seconds += msg.timing.ahead_us / 1e6

    def _pick(self, b: DraftBatch, offered) -> list | None:
        """Each request's offered branch for its committed history (None: it drafts nothing
        this round), or None unless every request that drafts has one. The key is the
        committed outcome alone, as the worker's own lookup."""
        picked = []
        for rid, L, k in zip(b.rids, b.lengths, b.k):
            got = offered.get((rid, L, self.hashes[rid])) if k > 0 else None
            if k > 0 and (got is None or len(got[0]) < k):
                return None
            picked.append(got)
        rows = {g[1] is None for g in picked if g is not None}
        return picked if len(rows) < 2 else None   # q rows for every draft or for none, as in a reply

    def _offered(self, b: DraftBatch, picked: list) -> tuple[list[list[int]], Tensor | None, None]:
        """The picked branches' drafts, cut to each request's k, with their q rows (checked)."""
        self.pushed_rounds += 1
        self.metrics.pushed_rounds += 1
        drafts = [[] if g is None else g[0][:k] for g, k in zip(picked, b.k)]
        hits = sum(1 for d in drafts if d)
        self.cache_hits += hits
        self.metrics.spec_cache_hits += hits
        used = [g[1][:k] if g[2] is None else dense_q(g[2][:k], g[1][:k], self.vocab)   # offers differ in width
                for g, k in zip(picked, b.k) if g is not None and g[1] is not None]
        if not used:
            return drafts, None, None
        rows = transfer(torch.cat(used), self.device)
        prob_values("draft_probs (offered by the draft worker)", rows)
        return drafts, rows, None

    def _accept(self, b: DraftBatch, reply) -> tuple[list[list[int]], Tensor | None, list | None]:
        """The drafts of a decoded reply (`hal.distributed.protocol.decode` checked its structure): one
        entry per request, q rows that are probabilities; drafts not built on the committed
        prefix (base length and hash) are dropped. Trees: each request's parents (None: chain)."""
        if not isinstance(reply, Drafts):
            raise HalError(f"draft worker reply: expected DRAFTS, got {type(reply).__name__}")
        R = len(b.rids)
        if reply.epoch != self.epoch:   # refused: built for another epoch's state
            self.metrics.stale_drafts += len(reply.entries)
            return [[] for _ in range(R)], None, None
        if len(reply.entries) != R or not (reply.hits <= R and reply.stale <= R):
            raise HalError(f"draft worker reply: expected {R} entries and cache counts at most that, "
                           f"got {len(reply.entries)} entries, counts {reply.hits}/{reply.stale}")
        self._count(reply)
        drafts, keep, r = [], [], 0
        for rid, L, k, e in zip(b.rids, b.lengths, b.k, reply.entries):
            d, n = e.tokens, len(e.tokens)
            ok = e.rid == rid and e.base_len == L and e.base_hash == self.hashes[rid] and n <= max(k, 0)
            if not ok:  # not built on the committed prefix: dropped
                self.metrics.stale_drafts += 1
                d = []
            keep += range(r, r + len(d))
            r += n
            drafts.append(d)
        parents = [e.parents if d else None for d, e in zip(drafts, reply.entries)]
        parents = parents if any(p is not None for p in parents) else None
        if reply.q is None or not keep:
            return drafts, None, parents
        rows = transfer(reply.q[keep], self.device)
        q = rows if reply.idx is None else dense_q(transfer(reply.idx[keep], self.device), rows, self.vocab)
        prob_values("draft_probs (from the draft worker)", q)
        return drafts, q, parents

    def _count(self, reply: Drafts) -> None:
        """The worker's speculation account (`hal.distributed.protocol.Timing`) into the metrics."""
        t, m = reply.timing, self.metrics
        self.cache_hits += reply.hits
        self.cache_misses += reply.stale
        m.spec_cache_hits += reply.hits
        m.spec_cache_misses += reply.stale
        m.fanout_branches += t.branches
        m.draft_ahead_seconds += t.ahead_us / 1e6
        m.draft_inline_seconds += t.inline_us / 1e6

    def _proposal(self, b: DraftBatch, drafts: list[list[int]], q: Tensor | None, parents=None) -> Proposal:
        """``k[i]`` slots per request: the worker's drafts first, then filler (token 0, a one-hot
        q row); ``num_valid`` the drafts' counts (host ints); a tree's parents (filler: chains)."""
        N = sum(b.k)
        ids = torch.zeros(N, dtype=torch.long)
        at, r = [], 0
        for d, k in zip(drafts, b.k):
            ids[r:r + len(d)] = torch.tensor(d, dtype=torch.long)
            at += range(r, r + len(d))
            r += k
        probs = None
        if q is not None:
            probs = torch.zeros(N, self.vocab, dtype=q.dtype, device=self.device)
            probs[:, 0] = 1
            probs[torch.tensor(at, dtype=torch.long).to(self.device)] = q
        cu = torch.tensor([0, *b.k]).cumsum(0)
        par = None
        if parents is not None:
            par = torch.tensor(trees.chain_parents(b.k), dtype=torch.long)
            for r, p in zip(cu.tolist(), parents):
                if p is not None:
                    par[r:r + len(p)] = torch.tensor(p, dtype=torch.long)
            par = par.to(self.device)
        return Proposal(draft_token_ids=ids.to(self.device), cu_num_draft_tokens=cu.to(self.device), draft_probs=probs,
                        num_valid=torch.tensor([len(d) for d in drafts]), parent_ids=par)

    def _fail(self, e: Exception, lost: bool = False) -> None:
        """Plain decoding from here. ``lost``: the link failed (not the worker's words), so a
        new epoch is announced for the worker to rejoin."""
        self.alive, self.lost = False, self.lost or lost
        self.metrics.draft_failures += 1
        again = lost and self.rendezvous is not None
        print(f"hal.launch: draft worker lost in epoch {self.epoch} ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:160]}); decoding plainly" + (", until it rejoins" if again else ""),
              file=sys.stderr, flush=True)
        if lost:
            self.metrics.workers_lost += 1
            self._drop_link()
        if again:
            self.epoch += 1
            self.rendezvous.announce(self.epoch)

    def _drop_link(self) -> None:
        """Forget the link: its process group closes, so a worker still waiting on it wakes."""
        self._bytes = [self.bytes_sent, self.bytes_received]
        self.link, self._inbox = None, None

    def take_back(self) -> bool:
        """Between steps (an idle server): take back a worker waiting to rejoin (`_rejoin`)."""
        return self.alive or self._rejoin()

    def _rejoin(self) -> bool:
        """Whether the worker rejoined (checked at most every 50 ms, never blocking unless it
        said it joins): the new epoch's link, every live request sent afresh."""
        rv = self.rendezvous
        if rv is None or not self.lost or time.monotonic() - self._asked < 0.05:
            return False
        self._asked = time.monotonic()
        if not rv.joining(self.epoch):
            return False
        try:
            group = rv.group(self.epoch, min(self.timeout, 10.0))
        except HalError as e:
            print(f"hal.launch: {e}; decoding plainly", file=sys.stderr, flush=True)
            self.epoch += 1
            rv.announce(self.epoch)
            return False
        self.link = Link(DRAFT, torch.device("cpu"), group, framed=True)   # later epochs are gloo
        self.sent, self.hashes, self.finished, self.commits = {}, {}, [], 0
        self._listen()
        self.alive, self.lost, self.rounds = True, False, 1   # no start-up wait: the worker is loaded
        self.metrics.workers_rejoined += 1
        print(f"hal.launch: draft worker rejoined (epoch {self.epoch}); speculating again",
              file=sys.stderr, flush=True)
        return True

    def commit(self, rids, kept) -> None:
        pass

    def release(self, rid) -> None:
        self.hashes.pop(rid, None)
        if self.sent.pop(rid, None) is not None:
            self.finished.append(rid)

    def close(self) -> None:
        if self.link is not None and not self.lost:  # a worker we stopped listening to (bad reply) still gets its STOP
            try:
                self.link.send(*encode(Stop())[:2])
                self.link.flush()
            except RuntimeError:
                pass
            if self._inbox is not None:   # push: the worker answers STOP, which ends the reader (bounded)
                self._reader.join(timeout=self.timeout)


def connect(rv, vocab: int, device: torch.device, metrics, *, draft_timeout: float, startup_timeout: float,
            features: tuple[int, ...] | None = None, push: bool = False) -> RemoteDrafter:
    """The target's view of the draft rank: epoch 0's link, or (the worker did not join within
    ``startup_timeout``) none yet, with epoch 1 open for it to join late (counted in
    ``metrics.draft_failures``). ``features``: the target layers an EAGLE head reads."""
    rv.announce(0)   # ready to meet: the bound starts now, not at process start
    try:
        gloo = rv.backend == "gloo"
        link = Link(DRAFT, torch.device("cpu") if gloo else device, rv.group(0, startup_timeout), framed=gloo)
    except HalError as e:
        print(f"hal.launch: the draft worker did not join within {startup_timeout} s ({e}); serving alone by "
              "plain decoding until it joins", file=sys.stderr, flush=True)
        link = None
        metrics.draft_failures += 1
    return RemoteDrafter(link, vocab, device, metrics, draft_timeout, first_timeout=startup_timeout,
                         features=features, rendezvous=rv, push=push)
