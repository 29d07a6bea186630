"""The per-request draft KV that model drafters and EAGLE heads keep: their own pool, one
sequence per request, and how many leading positions of it hold committed history (the
rest is scratch from the last drafts)."""

from __future__ import annotations

from hal import kv


class DraftKV:
    """A drafter's KV bookkeeping: per request its draft sequence and how many leading
    positions hold its committed history (`valid_len`, set only through `mark_valid`)."""

    def __init__(self, pool: kv.KVPool):
        self.pool = pool
        self.seqs: dict[int, kv.Sequence] = {}
        self._valid: dict[int, int] = {}

    def valid_len(self, rid: int) -> int:
        """Leading positions of ``rid``'s draft sequence that hold its committed history (0: none)."""
        return self._valid.get(rid, 0)

    def mark_valid(self, rid: int, n: int) -> None:
        """The first ``n`` positions of ``rid``'s draft sequence now hold its committed history."""
        self._valid[rid] = n

    def sequence(self, rid: int) -> kv.Sequence:
        """Request ``rid``'s draft sequence (a new, empty one the first time)."""
        return self.seqs.setdefault(rid, self.pool.sequence())

    def blocks_needed(self, rid: int, num_tokens: int) -> int:
        """New blocks request ``rid``'s sequence needs to hold ``num_tokens`` positions."""
        have = len(self.seqs[rid].blocks) if rid in self.seqs else 0
        return max(0, -(-num_tokens // self.pool.allocator.block_size) - have)

    @property
    def num_free(self) -> int:
        return self.pool.allocator.num_free

    def release(self, rid: int) -> None:
        """Free request ``rid``'s blocks and forget it."""
        if (seq := self.seqs.pop(rid, None)) is not None:
            seq.free()
        self._valid.pop(rid, None)
