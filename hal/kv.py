"""Host side of the paged KV cache: a block allocator, per-sequence block tables
(append, rollback, copy-on-write fork, free) and device pools sized to what the
backend supports. Draft and target each get their own `KVPool`."""

from __future__ import annotations

import torch

from hal.errors import HalError, arg_error


def _count(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise arg_error(name, "a Python int", type(v).__name__)
    if v < lo:
        raise arg_error(name, f"an int >= {lo}", v)
    return v


class BlockAllocator:
    """Reference-counted physical blocks ``0..num_blocks-1``.

    Every method is all or nothing: one that raises `HalError` has changed nothing.
    """

    def __init__(self, num_blocks: int, block_size: int):
        _count("num_blocks", num_blocks, 1)
        _count("block_size", block_size, 1)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _exhausted(self, need: int) -> HalError:
        return HalError(f"KV pool: expected {need} free block{'s' * (need != 1)}, got {self.num_free} of "
                        f"{self.num_blocks} (raise num_blocks or finish some sequences)")

    def allocate(self) -> int:
        if not self._free:
            raise self._exhausted(1)
        b = self._free.pop()
        self.refcount[b] = 1
        return b

    def _live(self, b: int) -> None:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
            raise arg_error("block", f"a block id in [0, {self.num_blocks})", b)
        if self.refcount[b] <= 0:
            raise HalError(f"block {b}: expected a live block, got a free one (double free or use after free)",
                           arg="block", expected="a live block", got="a free one")

    def incref(self, b: int) -> None:
        self._live(b)
        self.refcount[b] += 1

    def decref(self, b: int) -> None:
        self._live(b)
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self._free.append(b)


class Sequence:
    """One sequence's block table. ``length`` counts committed tokens.

    A step ``reserve(n)`` returns slots for positions ``length..length+n-1``;
    ``commit(m)`` then advances ``length`` by the ``m <= n`` tokens that were
    kept. Rejected tokens are never erased: their slots are simply overwritten
    by the next reservation (rollback is free).

    Every method is all or nothing: one that raises `HalError` (bad argument,
    pool exhausted, sequence already freed) leaves the sequence, every other
    sequence and the allocator exactly as they were. A freed sequence is dead:
    every later call raises.
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.blocks: list[int] = []
        self.length = 0
        self.reserved = 0
        self.freed = False

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def _alive(self, what: str) -> None:
        if self.freed:
            raise HalError(f"Sequence.{what}: expected a live sequence, got one already freed",
                           arg="sequence", expected="a live sequence", got="a freed one")

    def slot(self, pos: int) -> int:
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def reserve(self, n: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Slots for the next ``n`` positions, and ``(src_block, dst_block)`` copies
        that must run (``copy_kv``) before writing: copy-on-write of shared blocks.

        Counts every block it needs (new ones and copies) before taking any, so an
        exhausted pool raises with nothing changed."""
        self._alive("reserve")
        _count("n", n)
        a, bs = self.allocator, self.block_size
        need = -(-(self.length + n) // bs)
        shared = [bi for bi in range(self.length // bs, min(need, len(self.blocks)))
                  if a.refcount[self.blocks[bi]] > 1]
        wanted = max(0, need - len(self.blocks)) + len(shared)
        if wanted > a.num_free:
            raise a._exhausted(wanted)
        copies = []
        for bi in shared:  # shared with a fork: copy before writing
            b, nb = self.blocks[bi], a.allocate()
            a.decref(b)
            self.blocks[bi] = nb
            copies.append((b, nb))
        while len(self.blocks) < need:
            self.blocks.append(a.allocate())
        self.reserved = n
        return [self.slot(p) for p in range(self.length, self.length + n)], copies

    def commit(self, m: int) -> None:
        """Keep the first ``m`` reserved tokens (accepted drafts + 1)."""
        self._alive("commit")
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= self.reserved:
            raise arg_error("m", f"an int, 0 <= m <= reserved ({self.reserved})", m)
        self.length += m
        self.reserved = 0

    def truncate(self, length: int) -> None:
        """Roll the committed length back; blocks stay allocated for reuse."""
        self._alive("truncate")
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise arg_error("length", f"an int, 0 <= length <= {self.length}", length)
        self.length, self.reserved = length, 0

    def fork(self) -> "Sequence":
        """A child sharing every block (copy-on-write on its next write)."""
        self._alive("fork")
        child = Sequence(self.allocator)
        child.blocks, child.length = list(self.blocks), self.length
        for b in child.blocks:
            self.allocator.incref(b)
        return child

    def free(self) -> None:
        """Return every block; the sequence is dead afterwards (freeing twice raises)."""
        self._alive("free")
        for b in self.blocks:
            self.allocator._live(b)
        for b in self.blocks:
            self.allocator.decref(b)
        self.blocks, self.length, self.reserved, self.freed = [], 0, 0, True


def block_copy_slots(copies: list[tuple[int, int]], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand ``(src_block, dst_block)`` pairs into ``copy_kv`` slot tensors."""
    off = torch.arange(block_size)
    src = torch.tensor([s for s, _ in copies], dtype=torch.long)[:, None] * block_size + off
    dst = torch.tensor([d for _, d in copies], dtype=torch.long)[:, None] * block_size + off
    return src.reshape(-1), dst.reshape(-1)


def block_tables(seqs: list[Sequence], width: int | None = None) -> torch.Tensor:
    """``[R, width]`` int32 block tables, padded with 0 (never read past seq_len)."""
    width = width if width is not None else max((len(s.blocks) for s in seqs), default=0)
    out = torch.zeros(len(seqs), max(width, 1), dtype=torch.int32)
    for r, s in enumerate(seqs):
        out[r, :len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
    return out


class KVPool:
    """Device caches for ``num_layers`` layers plus their allocator.

    The block size and head_dim must be supported by the backend
    (``backend.spec.block_sizes``, ``backend.spec.head_dim_align``); a pool
    is checked before anything is allocated.
    """

    def __init__(self, backend, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, num_layers: int = 1, device: str | None = None):
        _count("num_blocks", num_blocks, 1)
        if block_size not in backend.spec.block_sizes:
            raise arg_error("block_size", f"{backend.spec.block_sizes} for backend {backend.name}", block_size)
        if _count("head_dim", head_dim, 1) % backend.spec.head_dim_align:
            raise arg_error("head_dim", f"a multiple of {backend.spec.head_dim_align} for backend {backend.name}",
                            head_dim)
        for name, v in (("num_kv_heads", num_kv_heads), ("num_layers", num_layers)):
            _count(name, v, 1)
        self.backend, self.allocator = backend, BlockAllocator(num_blocks, block_size)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        dev = device or backend.device_type
        self.k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]

    def sequence(self) -> Sequence:
        return Sequence(self.allocator)
