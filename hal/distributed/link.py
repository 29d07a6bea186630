"""The two ranks' transport (`hal.distributed.protocol` is what travels): `Link`, int64 words,
optional float32 rows and optional int32 sparse indices over torch.distributed point-to-point,
and `LocalLink`, the same interface between two threads of one process. Every header a peer
announces is checked before anything is allocated."""

from __future__ import annotations

import datetime
import queue

import torch
import torch.distributed as dist
from torch import Tensor

from hal.errors import HalError
from hal.devices import transfer
from hal.distributed.protocol import MAX_COLS, MAX_ROWS, MAX_WORDS


class Link:
    """Messages between the two ranks: int64 words, optional float32 rows, optional int32
    indices (sparse q). Sends are non-blocking; a receive may time out. ``group``: the epoch's
    process group (`hal.distributed.rendezvous`); None: the default group.

    ``framed`` (gloo): a message travels as one byte tensor of exactly `CHUNK` bytes (header,
    words, rows, indices, zero padding), and only a longer message's remainder as a second
    tensor (its size is in the header). Each gloo tensor costs a round trip of its own
    (measured: 3 tensors each way at 5.3 ms RTT, 28.6 ms; 1 tensor, 5.7 ms), so a round is one
    round trip, not four. Otherwise (nccl, hccl) the header, words, rows and indices go as
    tensors of their own."""

    def __init__(self, peer: int, device: torch.device, group=None, framed: bool = False):
        self.peer, self.device, self.group, self._sending, self._keep = peer, device, group, [], []
        self.framed, self._buf = framed, None
        self.bytes_sent = self.bytes_received = 0   # payload bytes, headers included

    def flush(self) -> None:
        """Wait until the last message has left (once: a gloo work waited twice waits for another send)."""
        sending, self._sending = self._sending, []
        for w in sending:
            w.wait()

    def send(self, words: list[int], rows: Tensor | None = None, idx: Tensor | None = None) -> None:
        self.flush()
        parts = [torch.tensor(words, dtype=torch.long)]
        parts += [rows.float().contiguous()] if rows is not None else []
        parts += [idx.to(torch.int32).contiguous()] if idx is not None else []
        r = rows.shape if rows is not None else (0, 0)
        head = torch.tensor([len(words), r[0], r[1], idx is not None], dtype=torch.long)
        parts = [head] + parts
        if self.framed:
            blob = torch.cat([t.cpu().reshape(-1).view(torch.uint8) for t in parts])
            first = torch.zeros(CHUNK, dtype=torch.uint8)
            first[:min(CHUNK, blob.numel())] = blob[:CHUNK]
            parts = [first] + ([blob[CHUNK:]] if blob.numel() > CHUNK else [])
        parts = [transfer(t, self.device) for t in parts]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in parts)
        self._sending = [dist.isend(t, self.peer) if self.group is None else self.group.send([t], self.peer, 0)
                         for t in parts]
        self._keep = parts

    def recv(self, timeout: float | None) -> tuple[list[int], Tensor | None, Tensor | None]:
        """One message. The header comes from another process: sizes it announces are checked
        before anything is allocated (`HalError` when out of bounds)."""
        if self.framed:
            return self._recv_framed(timeout)
        head = _checked(self._recv(torch.empty(4, dtype=torch.long), timeout).tolist())
        words = self._recv(torch.empty(head[0], dtype=torch.long), timeout).tolist()
        rows = self._recv(torch.empty(head[1], head[2]), timeout) if head[1] else None
        idx = self._recv(torch.empty(head[1], head[2], dtype=torch.int32), timeout) if head[1] and head[3] else None
        return words, rows, idx

    def _recv_framed(self, timeout: float | None):
        buf = self._recv(torch.empty(CHUNK, dtype=torch.uint8), timeout).cpu()
        head = _checked(buf[:32].view(torch.long).tolist())
        nw, cells = head[0], head[1] * head[2]
        total = 32 + 8 * nw + 4 * cells * (1 + head[3])
        blob = buf[:total].clone()
        if total > CHUNK:
            blob = torch.cat([blob, self._recv(torch.empty(total - CHUNK, dtype=torch.uint8), timeout).cpu()])
        at = 32 + 8 * nw
        words = blob[32:at].view(torch.long).tolist()
        rows = blob[at:at + 4 * cells].view(torch.float32).reshape(head[1], head[2]) if head[1] else None
        idx = (blob[at + 4 * cells:total].view(torch.int32).reshape(head[1], head[2]) if head[1] and head[3]
               else None)
        return words, rows, idx

    def _recv(self, t: Tensor, timeout: float | None) -> Tensor:
        t = t.to(self.device)
        work = dist.irecv(t, self.peer) if self.group is None else self.group.recv([t], self.peer, 0)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        self.bytes_received += t.numel() * t.element_size()
        return t


CHUNK = 8 << 10   # bytes of a framed message's first tensor (`Link`): a round's COMMIT and DRAFTS fit


def _size(words: list[int], rows: Tensor | None, idx: Tensor | None) -> int:
    """A message's bytes as a process link counts them: header, int64 words, 4-byte rows and indices."""
    return 32 + 8 * len(words) + sum(t.numel() * 4 for t in (rows, idx) if t is not None)


class LocalLink:
    """`Link`'s interface between two threads of one process (`hal.distributed.local`): a
    message is copied at send (the sender may reuse its tensors) and its header checked at
    receive, as a process link checks it. A receive that times out, or whose peer thread
    failed (an exception put in its inbox), raises RuntimeError, as a lost process link does."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self.inbox, self.outbox = inbox, outbox
        self.bytes_sent = self.bytes_received = 0

    @staticmethod
    def pair() -> tuple["LocalLink", "LocalLink"]:
        """Two ends joined to each other."""
        a, b = queue.Queue(), queue.Queue()
        return LocalLink(a, b), LocalLink(b, a)

    def flush(self) -> None:
        pass

    def send(self, words: list[int], rows: Tensor | None = None, idx: Tensor | None = None) -> None:
        rows = None if rows is None else rows.float().clone()
        idx = None if idx is None else idx.to(torch.int32).clone()
        self.bytes_sent += _size(words, rows, idx)
        self.outbox.put((list(words), rows, idx))

    def recv(self, timeout: float | None) -> tuple[list[int], Tensor | None, Tensor | None]:
        try:
            got = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no message from the other thread within {timeout} s") from None
        if isinstance(got, BaseException):
            raise RuntimeError(f"the other thread failed: {type(got).__name__}: {got}") from got
        words, rows, idx = got
        r = rows.shape if rows is not None else (0, 0)
        _checked([len(words), r[0], r[1], int(idx is not None)])
        if idx is not None and idx.shape != rows.shape:
            raise HalError(f"hal.launch: expected sparse indices shaped as the rows {list(r)}, got {list(idx.shape)}")
        self.bytes_received += _size(words, rows, idx)
        return words, rows, idx


def _checked(head: list[int]) -> list[int]:
    if not (1 <= head[0] <= MAX_WORDS and 0 <= head[1] <= MAX_ROWS and 0 <= head[2] <= MAX_COLS
            and head[1] * head[2] <= MAX_ROWS * 64 and head[3] in (0, 1)):
        raise HalError(f"hal.launch: expected a message header within bounds, got {head}")
    return head
