"""The target features of prefix-cached blocks, for a drafter that reads them (an EAGLE head,
the block drafter), so automatic prefix caching stays on with such a drafter.

A request admitted on cached KV blocks skips their prefill, so the target never computes
those positions' features again; the drafter still needs them (its own KV or context cache
is per request). `FeatureCache` keeps each cached block's feature rows under the block's name
(`hal.kv.block_hashes`: a chain over its tokens and every token before it), within a byte
bound: rows of blocks the KV pool has evicted go first, then the least recently used (a finished
request's blocks last first, as vLLM frees them: a later request can only use a prefix). The
rows are the forward's own outputs, and the linear plan makes a row's bits independent of how
many rows came with it, so a request started on cached blocks passes its drafter the same
features a full prefill would have: the same drafts.

Glossary:
- tail: a request's feature rows from its first unsaved position on (a block boundary), kept
  until its blocks are named; `add` moves each named block's rows into the cache.
- leading: how many of a request's block names, from the first, the cache holds; admission
  (`hal.engine.prefix.lookup`) and adoption take no more KV blocks than that."""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Callable, Sequence as Seq

import torch
from torch import Tensor

from hal.errors import arg_error

CACHE_BYTES = 256 << 20   # the default bound on cached feature rows (256 MiB)
STALE_SCAN = 64           # a full cache looks this far into the least recently used for rows of evicted KV blocks


def bound(max_bytes) -> int:
    """``max_bytes`` checked: an int >= 0 (`HalError` naming ``feature_cache_bytes`` otherwise)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise arg_error("feature_cache_bytes", "an int >= 0 (bytes of cached feature rows)", max_bytes)
    return max_bytes


class FeatureCache:
    """Feature rows of named blocks (``block_size`` rows each), within ``max_blocks`` blocks and
    ``max_bytes`` bytes; the per-request tails of rows not yet in a named block. ``cached``:
    whether the KV pool still holds a block of that name (rows of an evicted block go first)."""

    def __init__(self, block_size: int, max_blocks: int, max_bytes: int = CACHE_BYTES,
                 cached: Callable[[bytes], bool] = lambda name: True):
        self.block_size, self.max_blocks, self.max_bytes, self.cached = block_size, max_blocks, max_bytes, cached
        self._rows: OrderedDict[bytes, Tensor] = OrderedDict()   # least recently used first
        self._tails: dict[int, tuple[int, list[Tensor], int]] = {}   # rid -> (position of its first row, rows, count)
        self._used: dict[int, list[bytes]] = {}                   # rid -> the blocks it started on or saved
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._rows)

    def leading(self, names: Seq[bytes]) -> int:
        """How many of ``names``, from the first, have their rows here (changes nothing)."""
        n = 0
        while n < len(names) and names[n] in self._rows:
            n += 1
        return n

    def take(self, names: Seq[bytes]) -> Tensor:
        """The rows of blocks ``names`` (each held: see `leading`), in order: [len(names) * block_size, F]."""
        self._refresh(names)
        return torch.cat([self._rows[name] for name in names])

    def resume(self, rid: int, names: Seq[bytes]) -> list[Tensor]:
        """Request ``rid`` starts on blocks ``names`` (each held: see `leading`): their rows, as a
        list for its pending features ([] for none), and its tail begins where they end."""
        self._tails[rid], self._used[rid] = (len(names) * self.block_size, [], 0), list(names)
        return [self.take(names)] if names else []

    def add(self, rid: int, position: int, rows: Tensor, names: Seq[bytes]) -> None:
        """Rows of request ``rid``'s positions ``position ..``; then the rows of its named blocks
        (``names``: its sequence's block names so far) that its tail covers are cached, and the
        tail keeps what follows. Rows that do not continue the tail (it started elsewhere) begin
        a new one there."""
        at, tail, count = self._tails.get(rid, (position, [], 0))
        if at + count != position:
            at, tail, count = position, [], 0
        tail, count = tail + [rows], count + rows.shape[0]
        bs = self.block_size
        first, last = -(-at // bs), min(len(names), (at + count) // bs)
        if last > first:
            whole = torch.cat(tail)
            for b in range(first, last):
                self._put(names[b], whole[b * bs - at:(b + 1) * bs - at].clone())
            self._used.setdefault(rid, []).extend(names[first:last])
            self._refresh(names[:last])
            at, tail = last * bs, [whole[last * bs - at:].clone()]   # not a view that keeps the chunk alive
            count = tail[0].shape[0]
        self._tails[rid] = (at, tail, count)

    def release(self, rid: int) -> None:
        """Request ``rid`` is done (or preempted): its blocks become the most recently used, its first
        the most of all (vLLM frees a request's blocks last first: a later request can only use a prefix)."""
        self._tails.pop(rid, None)
        self._refresh(self._used.pop(rid, []))

    def _refresh(self, names: Seq[bytes]) -> None:
        for name in reversed(names):
            if name in self._rows:
                self._rows.move_to_end(name)

    def _put(self, name: bytes, rows: Tensor) -> None:
        if name in self._rows:
            return
        self._rows[name] = rows
        self.bytes += rows.nbytes
        if len(self._rows) > self.max_blocks or self.bytes > self.max_bytes:   # rows of evicted KV blocks first,
            for old in [n for n in islice(self._rows, STALE_SCAN) if n != name and not self.cached(n)]:
                self._drop(old)                                                  # among the least recently used
        while len(self._rows) > self.max_blocks or self.bytes > self.max_bytes:
            self._drop(next(iter(self._rows)))

    def _drop(self, name: bytes) -> None:
        self.bytes -= self._rows.pop(name).nbytes
        self.evictions += 1
