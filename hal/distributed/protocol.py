"""The two-rank protocol's messages: their kinds, the bounds a peer's header may announce,
the chained history hash both sides keep, and one typed class, encoder and decoder per kind
(what `hal.distributed.link.Link` carries: int64 words, optional float32 rows, optional int32
sparse indices).

One round: the target sends COMMIT (the tokens committed since the last round and each
request's k); the worker answers DRAFTS built on exactly that committed prefix (base
length and hash per request), or the target gets STOP at the end. See `hal.launch.start`.
With push (`hal.distributed.remote.RemoteDrafter`'s ``push``), the worker also sends OFFER
while the target verifies: the branches it drafted ahead, so that a COMMIT whose every
request was offered asks for no reply."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hal.errors import HalError

COMMIT, DRAFTS, STOP, OFFER = 1, 2, 3, 4
DRAFTS_HEAD = 7   # words before a DRAFTS (or OFFER) message's first entry
MAX_WORDS, MAX_ROWS, MAX_COLS = 1 << 24, 1 << 20, 1 << 20  # what a peer's message header may announce
MAX_EPOCH = 1 << 40
TARGET, DRAFT = 0, 1
DRAFT_SEED = 1 << 40  # the worker's draws use (seed + DRAFT_SEED, offset): a stream the target never uses


HASH_SEED = 1469598103934665603


def history_hash(tokens: list[int], h: int = HASH_SEED) -> int:
    """A chained hash of a token history; ``history_hash(b, history_hash(a)) == history_hash(a + b)``,
    so each side extends it with the tokens committed since the last round only."""
    for t in tokens:
        h = ((h ^ (t + 1)) * 1099511628211) & ((1 << 62) - 1)
    return h


# -- the messages: one typed class per kind, one encoder and one decoder each ----------------------
# Wire form: int64 words (kind first), optional float32 rows, optional int32 indices (sparse q).
#   COMMIT: [COMMIT, epoch, reply, n, n_finished, *finished, n x (rid, k, length, new, [top_k, seed, max_new,
#            temperature, top_p (IEEE-754 float64 bits)] if new, n_delta, *delta, n_features)],
#           rows: the target's features, n_features rows per request in order (an EAGLE head's input)
#   DRAFTS: [DRAFTS, epoch, hits, misses, branches, ahead_us, inline_us,
#            n x (rid, base_len, base_hash, n_drafts, *drafts, n_parents, *parents)],
#           n_parents 0 (a chain) or n_drafts (a draft tree: each draft's local parent, -1 the root)
#           rows: q rows of the drafts (dense [N, V], or sparse values with ``idx``)
#   OFFER:  [OFFER, epoch, seq, final, branches, ahead_us, 0, entries as DRAFTS'], rows as DRAFTS'
#           (branches drafted ahead after the worker's seq-th COMMIT of the epoch; final: its last offer then)
#   STOP:   [STOP]
#   reply: 0 when every request's drafts were offered (the worker answers nothing), else 1
#   epoch: the rendezvous the link belongs to (`hal.distributed.rendezvous`); the worker echoes it


@dataclass
class NewRequest:
    """Sampling parameters of a request the worker has not seen yet."""

    top_k: int
    seed: int
    max_new_tokens: int
    temperature: float
    top_p: float


@dataclass
class CommitEntry:
    rid: int
    k: int
    length: int              # the committed history's length after ``delta``
    delta: list[int]         # tokens committed since the last round
    new: NewRequest | None = None
    features: Tensor | None = None  # [n, F] the target's features not sent before (`hal.engine.drafting.DraftBatch`)

    def __eq__(self, other) -> bool:
        f, g = self.features, getattr(other, "features", None)
        return (isinstance(other, CommitEntry) and (self.rid, self.k, self.length, self.delta, self.new)
                == (other.rid, other.k, other.length, other.delta, other.new)
                and ((f is None and g is None) or (f is not None and g is not None and torch.equal(f, g))))


@dataclass
class Commit:
    entries: list[CommitEntry]
    finished: list[int] = field(default_factory=list)
    epoch: int = 0
    reply: bool = True       # False: the target took every request's drafts from the worker's offers


@dataclass
class DraftEntry:
    rid: int
    base_len: int            # the committed history the drafts were built on: its length
    base_hash: int           # and its `history_hash`
    tokens: list[int]
    parents: list[int] | None = None   # a draft tree: each draft's local parent (-1: the root), parents first


@dataclass
class Timing:
    """The worker's account of a reply (`hal.distributed.speculate`), for the metrics."""

    branches: int = 0        # branches it drafted ahead while the target verified the last round
    ahead_us: int = 0        # microseconds that took (off the target's critical path)
    inline_us: int = 0       # microseconds from the COMMIT's arrival to this reply (on it)


@dataclass
class Drafts:
    hits: int                # requests answered from the speculation cache this round
    stale: int               # requests drafted ahead whose outcome was not among the branches (misses)
    entries: list[DraftEntry]
    q: Tensor | None = None  # [N, V] rows (dense), or the values of a sparse form with ``idx``
    idx: Tensor | None = None
    epoch: int = 0           # the COMMIT's epoch this answers
    timing: Timing = field(default_factory=Timing)


@dataclass
class Offer:
    """Branches the worker drafted ahead (`hal.distributed.speculate`), pushed while the target
    verifies: each entry is one branch's drafts under its history's key (length, hash), a
    request's several branches in several entries."""

    seq: int                 # the worker's COMMITs of this epoch before it drafted them
    final: bool              # the worker's last offer after that COMMIT
    entries: list[DraftEntry]
    q: Tensor | None = None  # as `Drafts.q`
    idx: Tensor | None = None
    epoch: int = 0
    timing: Timing = field(default_factory=Timing)   # final: the round's branches and time drafting ahead


@dataclass
class Stop:
    pass


Message = Commit | Drafts | Offer | Stop


def encode(msg: Message) -> tuple[list[int], Tensor | None, Tensor | None]:
    """``(words, rows, idx)`` for `hal.distributed.link.Link.send`."""
    if isinstance(msg, Stop):
        return [STOP], None, None
    if isinstance(msg, Commit):
        words, feats = [COMMIT, msg.epoch, int(msg.reply), len(msg.entries), len(msg.finished), *msg.finished], []
        for e in msg.entries:
            words += [e.rid, e.k, e.length, int(e.new is not None)]
            if e.new is not None:
                words += [e.new.top_k, e.new.seed, e.new.max_new_tokens, float_word(e.new.temperature),
                          float_word(e.new.top_p)]
            n = 0 if e.features is None else e.features.shape[0]
            words += [len(e.delta), *e.delta, n]
            if n:
                feats.append(e.features)
        return words, torch.cat(feats) if feats else None, None
    t = msg.timing
    if isinstance(msg, Offer):
        words = [OFFER, msg.epoch, msg.seq, int(msg.final), t.branches, t.ahead_us, t.inline_us]
    else:
        words = [DRAFTS, msg.epoch, msg.hits, msg.stale, t.branches, t.ahead_us, t.inline_us]
    for e in msg.entries:
        words += [e.rid, e.base_len, e.base_hash, len(e.tokens), *e.tokens]
        words += [0] if e.parents is None else [len(e.parents), *e.parents]
    return words, msg.q, msg.idx


def float_word(x: float) -> int:
    """A float64 as the int64 word with its bits (exact both ways)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def word_float(w: int) -> float:
    return struct.unpack("<d", struct.pack("<q", w))[0]


class _Reader:
    """Words read in order; every read is bounds-checked (`HalError`, never IndexError)."""

    def __init__(self, words: list[int], what: str):
        self.words, self.at, self.what = words, 0, what

    def bad(self, expected: str, got) -> HalError:
        return HalError(f"{self.what}: expected {expected}, got {got}", arg=self.what, expected=expected, got=str(got))

    def take(self, n: int, name: str, lo: int | None = None, hi: int | None = None) -> list[int]:
        if n < 0 or self.at + n > len(self.words):
            raise self.bad(f"{n} more word(s) for {name} at word {self.at}", f"a message of {len(self.words)} words")
        out = self.words[self.at:self.at + n]
        self.at += n
        for v in out:
            if (lo is not None and v < lo) or (hi is not None and v >= hi):
                raise self.bad(f"{name} in [{lo}, {hi})", v)
        return out

    def one(self, name: str, lo: int | None = None, hi: int | None = None) -> int:
        return self.take(1, name, lo, hi)[0]

    def done(self) -> None:
        if self.at != len(self.words):
            raise self.bad(f"{self.at} words", len(self.words))


def decode(words: list[int], rows: Tensor | None, idx: Tensor | None, vocab: int | None = None,
           max_k: int = 1 << 10) -> Message:
    """The message in ``(words, rows, idx)`` from the peer: untrusted. Every count, length and
    token id (in ``[0, vocab)`` when ``vocab`` is known) is checked; a malformed message raises
    `HalError` naming what was expected. Values of q are checked by the receiver (a sum needs V)."""
    r = _Reader(list(words), "protocol message")
    kind = r.one("the message kind", COMMIT, OFFER + 1)
    if kind == STOP:
        r.done()
        return Stop()
    hi_tok = vocab if vocab is not None else 1 << 62
    epoch = r.one("the epoch", 0, MAX_EPOCH)
    if kind == COMMIT:
        reply = bool(r.one("the reply flag", 0, 2))
        n, n_done = r.one("the request count", 0, MAX_ROWS), r.one("the finished count", 0, MAX_ROWS)
        finished = r.take(n_done, "finished request ids", 0, 1 << 62)
        entries, counts = [], []
        for _ in range(n):
            rid, k, length = r.one("a request id", 0, 1 << 62), r.one("k", 0, max_k + 1), r.one("a length", 0, 1 << 40)
            new = None
            if r.one("the new flag", 0, 2):
                top_k, seed, max_new = r.one("top_k", -1, 1 << 31), r.one("a seed"), r.one("max_new_tokens", 1, 1 << 40)
                t, p = word_float(r.one("a temperature")), word_float(r.one("a top_p"))
                if not (0 <= t < float("inf") and 0 < p <= 1):
                    raise r.bad("a finite temperature >= 0 and top_p in (0, 1]", (t, p))
                new = NewRequest(top_k, seed, max_new, t, p)
            delta = r.take(r.one("a delta length", 0, MAX_WORDS), "committed token ids", 0, hi_tok)
            counts.append(r.one("a feature row count", 0, MAX_ROWS))
            entries.append(CommitEntry(rid, k, length, delta, new))
        r.done()
        total = sum(counts)
        if (rows is None) != (total == 0) or (rows is not None and (rows.dim() != 2 or rows.shape[0] != total)):
            raise r.bad(f"{total} feature rows", None if rows is None else list(rows.shape))
        if rows is not None and not bool(torch.isfinite(rows).all()):
            raise r.bad("finite features", "NaN or inf")
        at = 0
        for e, c in zip(entries, counts):
            e.features, at = (rows[at:at + c] if c else None), at + c
        return Commit(entries, finished, epoch, reply)
    if kind == OFFER:
        hits, stale = r.one("the offer's COMMIT count", 0, 1 << 40), r.one("the final flag", 0, 2)
    else:
        hits, stale = r.one("the cache hits", 0, MAX_ROWS), r.one("the cache misses", 0, MAX_ROWS)
    timing = Timing(r.one("the branch count", 0, MAX_WORDS), r.one("the time ahead", 0, 1 << 40),
                    r.one("the time inline", 0, 1 << 40))
    entries = []
    while r.at < len(r.words):
        rid, base_len, base_hash = r.one("a request id", 0, 1 << 62), r.one("a base length", 0, 1 << 40), r.one("a hash")
        tokens = r.take(r.one("a draft count", 0, max_k + 1), "draft token ids", 0, hi_tok)
        n_par = r.one("a parent count", 0, len(tokens) + 1)
        parents = r.take(n_par, "draft parents", -1, len(tokens)) if n_par else None
        if parents is not None and (n_par != len(tokens) or any(p >= j for j, p in enumerate(parents))):
            raise r.bad(f"0 or {len(tokens)} parents, each -1 or an earlier draft's index", parents)
        entries.append(DraftEntry(rid, base_len, base_hash, tokens, parents))
    total = sum(len(e.tokens) for e in entries)
    if rows is not None and (rows.dim() != 2 or rows.shape[0] != total
                             or (idx is None and vocab is not None and rows.shape[1] != vocab)):
        raise r.bad(f"{total} q rows" + (f" of width {vocab}" if vocab else ""), list(rows.shape))
    if idx is not None and (rows is None or idx.shape != rows.shape
                            or bool(((idx < 0) | (idx >= hi_tok)).any())):
        raise r.bad(f"sparse q indices in [0, {hi_tok}) shaped like its values", None if idx is None else list(idx.shape))
    if kind == OFFER:
        return Offer(hits, bool(stale), entries, rows, idx, epoch, timing)
    return Drafts(hits, stale, entries, rows, idx, epoch, timing)


def corrupted(words: list[int], how: str) -> list[int]:
    """A DRAFTS reply made invalid in one way (tests: the target must not trust it)."""
    w = list(words)
    count = DRAFTS_HEAD + 3   # the first request's draft count; its first draft follows
    if how == "kind":
        w[0] = 77
    elif how == "truncated":
        w = w[:max(DRAFTS_HEAD + 1, len(w) // 2)]
    elif how == "count":
        w[count] = 1 << 40
    elif how in ("oov", "negative"):
        w = w[:count] + [w[count] + 1] + [1 << 20 if how == "oov" else -3] + w[count + 1:]
    return w
