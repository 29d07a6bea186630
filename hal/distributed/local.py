"""A draft on a second device in this process, drafting one round ahead (issue 36, item 6).

The draft worker's loop (`hal.distributed.worker.draft_worker`: its speculation cache, its
fan-out over the likeliest outcomes of the round being verified, the typed messages) runs on
a thread of its own against the drafter on its device. The engine's drafter is the same
`hal.distributed.remote.RemoteDrafter` a target uses across ranks, joined to that thread by a
`hal.distributed.link.LocalLink` (two in-process queues) instead of a process group. While
the target verifies round r the thread drafts round r+1; a COMMIT whose outcome was drafted is
answered at once. ATen releases the GIL inside its ops, so a drafter on another device (or on
other cores) runs beside the target's forward. The engine's code is unchanged and
device-agnostic: it sees one more drafter.

Exactness is the worker protocol's: each round's drafts draw at fixed Philox offsets on every
path, and the committed outcome alone selects the branch (tested across this link, with the
planted mutants, in tests/launch/test_generate.py and tests/distributed/test_local.py)."""

from __future__ import annotations

import threading

import torch

from hal.distributed.link import LocalLink
from hal.distributed.remote import RemoteDrafter
from hal.distributed.worker import draft_worker
from hal.engine.drafting import capabilities


class ThreadDrafter(RemoteDrafter):
    """``drafter`` one round ahead on its own thread (see the module docstring). ``fanout``:
    branches drafted ahead per request and round (None: the worker's default for this
    drafter; 0: none, the thread then only drafts on demand). ``timeout``: the longest wait
    for a round's drafts before the target decodes plainly (the thread failed or hung). A
    failure on the thread reaches the target at its next receive, as a lost worker. ``push``,
    ``wait_offers``: as `hal.distributed.remote.RemoteDrafter`'s (the branches offered while the
    target verifies)."""

    def __init__(self, drafter, vocab: int, device: torch.device, metrics, *, timeout: float = 30.0,
                 fanout: int | None = None, bounded: bool = True, push: bool = False, wait_offers: bool = False):
        mine, theirs = LocalLink.pair()
        super().__init__(mine, vocab, device, metrics, timeout, first_timeout=timeout,
                         features=capabilities(drafter).features, push=push, wait_offers=wait_offers)
        self.drafter = drafter
        self.thread = threading.Thread(target=self._serve, args=(theirs, fanout, bounded, push), daemon=True,
                                       name="hal-draft-ahead")
        self.thread.start()

    def _serve(self, link: LocalLink, fanout: int | None, bounded: bool, push: bool) -> None:
        try:
            with torch.inference_mode():   # thread-local: drafting never records autograd (as the worker rank's)
                draft_worker(link, self.drafter, fanout=fanout, bounded=bounded, push=push)
        except BaseException as e:   # the target's next receive raises it (a lost worker: plain decoding)
            link.outbox.put(e)

    def close(self) -> None:
        """STOP to the thread (`RemoteDrafter.close`), then wait for it, at most ``timeout``."""
        super().close()
        self.thread.join(timeout=self.timeout)
