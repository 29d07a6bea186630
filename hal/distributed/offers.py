"""The branches a draft worker pushes (``push``, issue 36 item 2): what it drafted ahead while
the target verifies, sent as OFFER so that a round whose every request's outcome was offered
waits for no reply (`hal.distributed.remote.RemoteDrafter` picks the branch). Used by
`hal.distributed.worker.draft_worker`."""

from __future__ import annotations

import torch

from hal.devices import sparse_q
from hal.distributed.link import Link
from hal.distributed.protocol import DraftEntry, Offer, Timing, encode
from hal.distributed.speculate import Drafted, FanOut


class Offers:
    """The worker's pushed branches (``push``), at most two OFFERs a round, each stamped with
    the COMMITs of the epoch it followed (``seq``): the first wave's branches (every request's
    likeliest) at once, then the rest with the round's last, marked final (it carries the
    round's branch count and time drafting ahead). A message costs both sides CPU while the
    target verifies (one per wave slowed the target's step at 5 ms RTT on shared cores:
    benchmarks/results/link-overlap-push-per-wave-avx2.md)."""

    def __init__(self, link: Link, on: bool, epoch: int):
        self.link, self.on, self.epoch, self.seq, self.closed = link, on, epoch, 0, False
        self.held: list[tuple[int, int, int, Drafted]] = []   # stored since the last offer
        self.sent = 0                                          # offers this round

    def committed(self) -> None:
        self.seq, self.closed, self.held, self.sent = self.seq + 1, False, [], 0

    def wave(self, stored: list[tuple[int, int, int, Drafted]], reqs: dict) -> None:
        """A wave's stored branches (`hal.distributed.speculate.FanOut.store`; ``reqs``: the
        worker's requests by id, their sampling parameters): the round's first goes at once."""
        if not self.on:
            return
        self.held += stored
        if not self.sent and self.held:
            self._send(False, Timing(), reqs)

    def close(self, fan: FanOut, current: bool, reqs: dict) -> None:
        """The round's fan-out is over: the final OFFER (once per round; none once the epoch
        is no longer ``current``)."""
        if self.on and not self.closed and current:
            self.closed = True
            self._send(True, Timing(fan.branches, int(1e6 * fan.ahead_s)), reqs)

    def _send(self, final: bool, timing: Timing, reqs: dict) -> None:
        stored, self.held, self.sent = [x for x in self.held if x[0] in reqs], [], self.sent + 1
        rows = [g.q for *_, g in stored if g.q is not None]
        if rows and len(rows) < len(stored):   # one message holds rows for every draft or none
            stored, rows = [x for x in stored if x[3].q is None], []
        idx, q = wire_q(rows, [reqs[r].params for r, *_ in stored])
        entries = [DraftEntry(rid, n, h, g.drafts) for rid, n, h, g in stored]
        self.link.send(*encode(Offer(self.seq, final, entries, q, idx, self.epoch, timing)))


def wire_q(rows: list[torch.Tensor], params: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(idx, q)`` for a message's q ``rows`` (each ``[n, V]``): concatenated, and sparse
    (`hal.devices.sparse_q`) when any of its requests (sampling ``params``) samples with top-k
    or top-p, since then each row is zero outside a few ids."""
    q = torch.cat(rows) if rows else None
    if q is not None and any(p.top_k > 0 or p.top_p < 1 for p in params):
        return sparse_q(q)
    return None, q
