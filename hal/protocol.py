"""The two-rank protocol's wire layer: message kinds, the bounds a peer's header may
announce, the chained history hash both sides keep, and `Link` (int64 words, optional
float32 rows, optional int32 sparse indices, over torch.distributed point-to-point).

One round: the target sends COMMIT (the tokens committed since the last round and each
request's k); the worker answers DRAFTS built on exactly that committed prefix (base
length and hash per request), or the target gets STOP at the end. See `hal.serve`."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import Tensor

from hal.errors import HalError
from hal.placement import transfer

COMMIT, DRAFTS, STOP = 1, 2, 3
MAX_WORDS, MAX_ROWS, MAX_COLS = 1 << 24, 1 << 20, 1 << 20  # what a peer's message header may announce
TARGET, DRAFT = 0, 1
DRAFT_SEED = 1 << 40  # the worker's draws use (seed + DRAFT_SEED, offset): a stream the target never uses


HASH_SEED = 1469598103934665603


def history_hash(tokens: list[int], h: int = HASH_SEED) -> int:
    """A chained hash of a token history; ``history_hash(b, history_hash(a)) == history_hash(a + b)``,
    so each side extends it with the tokens committed since the last round only."""
    for t in tokens:
        h = ((h ^ (t + 1)) * 1099511628211) & ((1 << 62) - 1)
    return h


class Link:
    """Messages between the two ranks: int64 words, optional float32 rows, optional int32
    indices (sparse q). Sends are non-blocking; a receive may time out."""

    def __init__(self, peer: int, device: torch.device):
        self.peer, self.device, self._sending, self._keep = peer, device, [], []

    def flush(self) -> None:
        """Wait until the last message has left."""
        for w in self._sending:
            w.wait()

    def send(self, words: list[int], rows: Tensor | None = None, idx: Tensor | None = None) -> None:
        self.flush()
        parts = [torch.tensor(words, dtype=torch.long)]
        parts += [rows.float().contiguous()] if rows is not None else []
        parts += [idx.to(torch.int32).contiguous()] if idx is not None else []
        r = rows.shape if rows is not None else (0, 0)
        head = torch.tensor([len(words), r[0], r[1], idx is not None], dtype=torch.long)
        parts = [transfer(t, self.device) for t in [head] + parts]
        self._sending = [dist.isend(t, self.peer) for t in parts]
        self._keep = parts

    def recv(self, timeout: float | None) -> tuple[list[int], Tensor | None, Tensor | None]:
        """One message. The header comes from another process: sizes it announces are checked
        before anything is allocated (`HalError` when out of bounds)."""
        head = self._recv(torch.empty(4, dtype=torch.long), timeout).tolist()
        if not (1 <= head[0] <= MAX_WORDS and 0 <= head[1] <= MAX_ROWS and 0 <= head[2] <= MAX_COLS
                and head[1] * head[2] <= MAX_ROWS * 64 and head[3] in (0, 1)):
            raise HalError(f"hal.serve: expected a message header within bounds, got {head}")
        words = self._recv(torch.empty(head[0], dtype=torch.long), timeout).tolist()
        rows = self._recv(torch.empty(head[1], head[2]), timeout) if head[1] else None
        idx = self._recv(torch.empty(head[1], head[2], dtype=torch.int32), timeout) if head[1] and head[3] else None
        return words, rows, idx

    def _recv(self, t: Tensor, timeout: float | None) -> Tensor:
        t = t.to(self.device)
        work = dist.irecv(t, self.peer)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        return t


def corrupted(words: list[int], how: str) -> list[int]:
    """A DRAFTS reply made invalid in one way (tests: the target must not trust it)."""
    w = list(words)
    first = 3 + 4  # the first request's first draft, when it has one
    if how == "kind":
        w[0] = 77
    elif how == "truncated":
        w = w[:max(4, len(w) // 2)]
    elif how == "count":
        w[3 + 3] = 1 << 40
    elif how in ("oov", "negative"):
        w = w[:3 + 3] + [w[3 + 3] + 1] + [1 << 20 if how == "oov" else -3] + w[first:]
    return w
