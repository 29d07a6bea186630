"""A draft in the target's process on its own thread, one round ahead
(`hal.distributed.local.ThreadDrafter`): the draft worker's loop and the target's
`RemoteDrafter` joined by `hal.distributed.link.LocalLink`. Greedy output equals plain
greedy, rounds are answered from the speculation cache, a failure on the thread leaves plain
decoding at once, and the link checks what it receives as a process link does. (The sampled
law across this path, with its planted mutants: tests/launch/test_generate.py.)"""

import pytest
import torch

from hal.distributed.local import ThreadDrafter
from hal.distributed.link import LocalLink
from hal.drafters import ModelDrafter
from hal.engine import Request, SpeculativeDecoder
from hal.errors import HalError
from hal.metrics import SpecDecodeMetrics
from hal.models.llama import random_llama

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 10, 11, 12]]


@pytest.fixture(scope="module")
def target():
    return random_llama(32, 2, 4, 2, 8, 64, 48, seed=3, scale=0.2, embed_scale=1.0)


def generate(target, drafter, metrics=None):
    dec = SpeculativeDecoder(target, drafter, num_blocks=64, metrics=metrics or SpecDecodeMetrics())
    return dec.generate([Request(list(p), max_new_tokens=24, k=0 if drafter is None else 3) for p in PROMPTS])


def test_a_draft_thread_keeps_greedy_output_and_answers_from_its_cache(target):
    """Built and run under inference mode, as the benchmarks and servers run (the mode is
    thread-local: the thread must enter it too, or the drafter's KV writes fail there)."""
    metrics = SpecDecodeMetrics()
    with torch.inference_mode():
        drafter = ThreadDrafter(ModelDrafter(target.layer_view(1)), target.cfg.vocab, target.device, metrics,
                                bounded=False)   # the whole fan-out before each COMMIT: hits whatever the timing
        out = generate(target, drafter, metrics)
    drafter.close()
    assert out == generate(target, None)
    assert metrics.total.num_draft_tokens > 0 and metrics.draft_failures == 0
    assert drafter.cache_hits > 0 and metrics.fanout_branches > drafter.cache_hits
    assert not drafter.thread.is_alive(), "the draft thread outlived its STOP"


class Failing(ModelDrafter):
    """PLANTED: the third drafter call raises."""

    calls = 0

    def propose(self, batch):
        Failing.calls += 1
        if Failing.calls == 3:
            raise ValueError("planted drafter failure")
        return super().propose(batch)


def test_a_failure_on_the_draft_thread_leaves_plain_decoding_at_once(target, capsys):
    """The thread's exception reaches the target at its next receive (not after the timeout):
    the rest decodes plainly, output unchanged, the failure counted and named."""
    metrics = SpecDecodeMetrics()
    drafter = ThreadDrafter(Failing(target.layer_view(1)), target.cfg.vocab, target.device, metrics, timeout=20,
                            fanout=0)
    out = generate(target, drafter, metrics)
    drafter.close()
    assert out == generate(target, None)
    assert metrics.draft_failures == 1 and not drafter.alive
    err = capsys.readouterr().err
    assert "the other thread failed: ValueError: planted drafter failure" in err, err[-2000:]


def test_the_local_link_checks_what_it_receives():
    a, b = LocalLink.pair()
    rows = torch.rand(2, 5)
    a.send([2, 0, 7], rows)
    rows.zero_()                                   # the sender reuses its tensor: the message was copied
    words, got, idx = b.recv(1.0)
    assert words == [2, 0, 7] and got.sum() > 0 and idx is None
    a.send([], None)                               # no words: not a message
    with pytest.raises(HalError, match="message header within bounds"):
        b.recv(1.0)
    b.outbox.put(([3], torch.rand(2, 4), torch.zeros(3, 4, dtype=torch.int32)))
    with pytest.raises(HalError, match="sparse indices shaped as the rows"):
        a.recv(1.0)
    with pytest.raises(RuntimeError, match="no message from the other thread within 0.01 s"):
        a.recv(0.01)


def test_offered_rows_of_two_widths_are_taken_whole_and_checked():
    """The two offers of a round are made sparse apart (each its own width): the target's rows
    for the drafts it takes are each branch's own, made dense. PLANTED: an offered q row that
    is no probability vector is refused (a draft failure's `HalError` naming the rows)."""
    from types import SimpleNamespace

    from hal.devices import sparse_q
    from hal.distributed.protocol import DraftEntry, Offer, encode
    from hal.distributed.remote import RemoteDrafter
    V = 6
    mine, theirs = LocalLink.pair()
    remote = RemoteDrafter(mine, V, torch.device("cpu"), SpecDecodeMetrics(), timeout=5, push=True,
                           wait_offers=True)
    remote.rounds = 1   # past the first round: `_offers` waits for the final offer (a reader thread moves them)
    a = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [0.25, 0.25, 0.5, 0, 0, 0]])
    b = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2, 0], [1.0, 0, 0, 0, 0, 0]])
    for rid, q in ((1, a), (2, b)):
        idx, vals = sparse_q(q)
        theirs.send(*encode(Offer(0, rid == 2, [DraftEntry(rid, 4, 40 + rid, [0, 2])], vals, idx)))
    offered = remote._offers()
    remote.hashes = {1: 41, 2: 42}
    batch = SimpleNamespace(rids=(1, 2), lengths=(4, 4), k=(2, 1))
    picked = remote._pick(batch, offered)
    drafts, rows, _ = remote._offered(batch, picked)
    assert drafts == [[0, 2], [0]] and torch.equal(rows, torch.cat([a, b[:1]]))
    bad = dict(offered)
    bad[(2, 4, 42)] = (bad[(2, 4, 42)][0], bad[(2, 4, 42)][1] * 2, bad[(2, 4, 42)][2])
    with pytest.raises(HalError, match="draft_probs"):
        remote._offered(batch, remote._pick(batch, bad))


@pytest.mark.parametrize("push", [False, True])
def test_a_worker_is_marked_stopped_only_after_its_last_send(target, push):
    """At STOP a pushing worker answers STOP (the target's reader waits on it); the rank
    destroys its process group once the epoch reads stopped, so that must come after the
    send and its flush (a group destroyed mid-send aborts the process: CI, stop 72). The
    link records the epoch's flag at each send and flush. PLANTED: marking it first fails."""
    import queue
    import threading

    from hal.distributed.protocol import STOP, Stop, encode
    from hal.distributed.worker import Epoch, draft_worker
    ep, seen = Epoch(), []

    class Watched(LocalLink):
        def send(self, words, rows=None, idx=None):
            seen.append(("send", words[0], ep.stopped))
            super().send(words, rows, idx)

        def flush(self):
            seen.append(("flush", None, ep.stopped))
            super().flush()
    a, b = queue.Queue(), queue.Queue()
    worker = threading.Thread(target=draft_worker, args=(Watched(a, b), ModelDrafter(target)),
                              kwargs=dict(epoch=ep, push=push), daemon=True)
    worker.start()
    LocalLink(b, a).send(*encode(Stop()))
    worker.join(30)
    assert not worker.is_alive() and ep.stopped
    assert [s for s in seen if s[:2] == ("send", STOP)] == ([("send", STOP, False)] if push else [])
    assert all(not stopped for _, _, stopped in seen)
