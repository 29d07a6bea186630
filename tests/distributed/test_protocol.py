"""The two-rank protocol's typed messages (`hal.distributed.protocol`): every message round-trips
through `encode` / `decode`, and anything else a peer may send (truncated, corrupted,
out-of-range) is either refused with `HalError` or decodes to exactly what it encodes to:
never another exception, never a silently different message."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hal
from hal.distributed.protocol import (DRAFTS_HEAD, OFFER, Commit, CommitEntry, DraftEntry, Drafts, NewRequest, Offer,
                                     Stop, Timing, decode, encode, history_hash)

V = 50
ids = st.integers(0, V - 1)
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None)


@st.composite
def commits(draw):
    entries = []
    for rid in draw(st.lists(st.integers(0, 1000), unique=True, max_size=5)):
        new = draw(st.none() | st.builds(NewRequest, st.integers(-1, 40), st.integers(-2 ** 63, 2 ** 63 - 1),
                                         st.integers(1, 500), st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                                         st.sampled_from([0.25, 0.5, 1.0])))
        delta = draw(st.lists(ids, max_size=6))
        entries.append(CommitEntry(rid, draw(st.integers(0, 8)), draw(st.integers(0, 99)), delta, new))
    return Commit(entries, draw(st.lists(st.integers(0, 1000), max_size=3)), reply=draw(st.booleans()))


@st.composite
def drafts(draw):
    entries = [DraftEntry(draw(st.integers(0, 1000)), draw(st.integers(0, 99)), history_hash(draw(st.lists(ids))),
                          draw(st.lists(ids, max_size=8))) for _ in range(draw(st.integers(0, 4)))]
    for e in entries:   # some are draft trees: each draft's parent is -1 or an earlier draft
        if e.tokens and draw(st.booleans()):
            e.parents = draw(st.tuples(*[st.integers(-1, j - 1) for j in range(len(e.tokens))]).map(list))
    n = sum(len(e.tokens) for e in entries)
    q = draw(st.sampled_from(["none", "dense", "sparse"]))
    if q == "none" or n == 0:
        return Drafts(draw(st.integers(0, 4)), draw(st.integers(0, 4)), entries)
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    rows = torch.rand(n, V if q == "dense" else 4, generator=g)
    idx = torch.randint(0, V, (n, 4), generator=g, dtype=torch.int32) if q == "sparse" else None
    return Drafts(len(entries), 0, entries, rows, idx)


@st.composite
def offers(draw):
    """OFFER: a DRAFTS' entries as branches (chains), stamped with a COMMIT count and a final flag."""
    d = draw(drafts())
    for e in d.entries:
        e.parents = None
    return Offer(draw(st.integers(0, 10 ** 6)), draw(st.booleans()), d.entries, d.q, d.idx,
                 timing=Timing(draw(st.integers(0, 64)), draw(st.integers(0, 10 ** 6))))


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    eq = lambda x, y: (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))  # noqa
    if isinstance(a, Drafts):
        return (a.hits, a.stale, a.entries) == (b.hits, b.stale, b.entries) and eq(a.q, b.q) and eq(a.idx, b.idx)
    if isinstance(a, Offer):
        return ((a.seq, a.final, a.entries, a.timing) == (b.seq, b.final, b.entries, b.timing)
                and eq(a.q, b.q) and eq(a.idx, b.idx))
    return a == b


def test_an_offer_is_checked_as_drafts_are():
    words = encode(Offer(3, True, [DraftEntry(3, 4, 5, [1, 2])]))[0]
    assert words[0] == OFFER and decode(words, None, None, vocab=V).final
    refused([OFFER, 0, 3, 2] + words[4:], None, "final flag")
    refused(words[:-2] + [V, 0], None, "draft token ids")
    commit = encode(Commit([CommitEntry(1, 2, 3, [4])], reply=False))[0]
    assert decode(commit, None, None, vocab=V).reply is False
    refused(commit[:2] + [2] + commit[3:], None, "reply flag")


@SETTINGS
@given(msg=st.one_of(commits(), drafts(), offers(), st.just(Stop())))
def test_every_message_round_trips(msg):
    assert same(decode(*encode(msg), vocab=V), msg)


@SETTINGS
@given(msg=st.one_of(commits(), drafts()), data=st.data())
def test_truncated_or_corrupted_words_are_refused_or_consistent(msg, data):
    words, rows, idx = encode(msg)
    how = data.draw(st.sampled_from(["truncate", "corrupt", "append"]))
    if how == "truncate":
        words = words[:data.draw(st.integers(0, len(words) - 1))]
    elif how == "corrupt":
        i = data.draw(st.integers(0, len(words) - 1))
        words = words[:i] + [data.draw(st.sampled_from([-1, -2 ** 40, V, 2 ** 40, 0, 1, 7]))] + words[i + 1:]
    else:
        words = words + data.draw(st.lists(st.integers(-5, 60), min_size=1, max_size=4))
    try:
        got = decode(words, rows, idx, vocab=V)
    except hal.HalError as e:
        assert "expected" in str(e) and "got" in str(e)
        return
    w2, r2, i2 = encode(got)       # accepted: it must be exactly the message those words spell
    assert w2 == words


def test_out_of_range_values_name_what_was_expected():
    words, rows, idx = encode(Drafts(0, 0, [DraftEntry(3, 4, 5, [1, 2])]))
    H = DRAFTS_HEAD
    for bad, what in ((words[:H] + [3, 4, 5, 2, 1, V], "draft token ids"), ([99], "message kind"),
                      (words[:H + 3] + [2 ** 40, 1, 2], "draft count"), ([words[0], -1] + words[2:], "epoch"),
                      (words[:4] + [-1] + words[5:], "branch count")):
        refused(bad, None, what)
    refused(encode(Commit([CommitEntry(1, 2, 3, [4], NewRequest(0, 1, 5, float("nan"), 1.0))]))[0], None,
            "temperature")


def test_the_epoch_travels_both_ways():
    for msg in (Commit([CommitEntry(1, 2, 3, [4])], [5], epoch=7), Drafts(0, 0, [DraftEntry(3, 4, 5, [1])], epoch=7)):
        words = encode(msg)[0]
        assert words[1] == 7 and decode(words, None, None, vocab=V).epoch == 7


def test_tree_parents_are_checked():
    words = encode(Drafts(0, 0, [DraftEntry(3, 4, 5, [1, 2, 3], [-1, 0, 0])]))[0]
    assert decode(words, None, None, vocab=V).entries[0].parents == [-1, 0, 0]
    for bad in (words[:-3] + [0, 0, 0],      # a draft its own parent
                words[:-3] + [-1, 2, 0],     # a parent after its child
                words[:-4] + [2, -1, 0],     # fewer parents than drafts
                words[:-3] + [-2, 0, 0]):    # below -1
        refused(bad, None, "parent")


def test_features_ride_with_commit_and_are_checked():
    f = torch.randn(5, 8)
    msg = Commit([CommitEntry(1, 2, 3, [4], None, f[:2]), CommitEntry(7, 0, 9, [], None, None),
                  CommitEntry(8, 1, 4, [1, 2], NewRequest(0, 1, 5, 0.5, 1.0), f[2:])])
    words, rows, idx = encode(msg)
    assert same(decode(words, rows, idx, vocab=V), msg) and rows.shape == (5, 8)
    for bad, what in ((rows[:4], "5 feature rows"), (None, "5 feature rows"),
                      (torch.cat([rows[:4], torch.full((1, 8), float("nan"))]), "finite features")):
        refused(words, bad, what)


def refused(words, rows, what: str) -> None:
    try:
        decode(words, rows, None, vocab=V)
    except hal.HalError as e:
        assert what in str(e), str(e)
    else:
        raise AssertionError(f"{what}: accepted")


def test_a_framed_link_carries_each_message_as_one_tensor():
    """Two gloo ranks in two threads: messages small and larger than `CHUNK` (rows and sparse
    indices) arrive exactly, one after another through the one reused buffer; a small one is
    one tensor on the wire."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from hal.distributed import link as protocol_link
    from hal.distributed.link import Link
    store = dist.HashStore()
    groups = [None, None]

    def make(r):
        groups[r] = dist.ProcessGroupGloo(dist.PrefixStore("t", store), r, 2, datetime.timedelta(seconds=30))
    ts = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    a, b = Link(1, torch.device("cpu"), groups[0], framed=True), Link(0, torch.device("cpu"), groups[1], framed=True)
    big = torch.rand(protocol_link.CHUNK // 4 // 64 + 3, 64)        # past one chunk: a second tensor
    msgs = [([7, 1, 2], None, None), ([5] * 1000, big, None), ([9, 9], big[:3], torch.arange(192).reshape(3, 64)),
            ([1], None, None)]
    got = []
    sender = threading.Thread(target=lambda: [a.send(*m) or a.flush() for m in msgs])
    sender.start()
    for _ in msgs:
        got.append(b.recv(30))
    sender.join(60)
    for (w, r, i), (gw, gr, gi) in zip(msgs, got):
        assert gw == w
        assert (gr is None and r is None) or torch.equal(gr, r.float())
        assert (gi is None and i is None) or torch.equal(gi, i.to(torch.int32))
    assert len(a._keep) == 1   # the last (small) message left as one tensor
