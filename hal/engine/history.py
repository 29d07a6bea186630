"""Every request's committed tokens, kept on the device: one row per request, from
`add` to `release`, written in place as tokens are committed. Drafters read views of
it (`hal.engine.drafting.DraftBatch.history`); nothing is rebuilt from Python lists per step.

Entries past a request's committed length are scratch: the engine writes a whole
verify result there (accepted or not) and readers go only up to the length."""

from __future__ import annotations

import torch
from torch import Tensor


class HistoryBuffer:
    """Rows of token ids on ``device``; they grow (doubling) when a request needs more."""

    def __init__(self, device, rows: int = 8, width: int = 256):
        self.device = torch.device(device)
        self.buf = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        self.row: dict[int, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def add(self, rid: int, tokens: list[int]) -> None:
        """Give ``rid`` a row holding ``tokens`` (one host-to-device copy)."""
        if not self._free:
            n = self.buf.shape[0]
            self.buf = torch.cat([self.buf, torch.zeros_like(self.buf)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        self.reserve(len(tokens))
        r = self._free[-1]
        self.buf[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
        self.row[rid] = self._free.pop()   # taken once written: a failed add leaves no row behind

    def release(self, rid: int) -> None:
        if (r := self.row.pop(rid, None)) is not None:
            self._free.append(r)

    def reserve(self, width: int) -> None:
        if width > self.buf.shape[1]:
            w = self.buf.shape[1]
            while w < width:
                w *= 2
            self.buf = torch.cat([self.buf, self.buf.new_zeros(self.buf.shape[0], w - self.buf.shape[1])], 1)

    def rows(self, rids) -> Tensor:
        return torch.tensor([self.row[r] for r in rids], dtype=torch.long).to(self.device, non_blocking=True)

    def write(self, rids: list[int], starts: list[int], values: Tensor) -> None:
        """``values[i]`` ([R, M], on this device) at positions ``starts[i]..`` of ``rids[i]``'s row."""
        if not rids:
            return
        M = values.shape[1]
        self.reserve(max(starts) + M)
        cols = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(M)
        self.buf[self.rows(rids)[:, None], cols.to(self.device, non_blocking=True)] = values.long()

    def view(self, rids: list[int], width: int) -> Tensor:
        """The rows of ``rids``, their first ``width`` columns: ``[R, width]`` (a copy)."""
        self.reserve(width)
        return self.buf.index_select(0, self.rows(rids))[:, :width]
