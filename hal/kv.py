"""Host side of the paged KV cache: a block allocator, per-sequence block tables
(append, rollback, copy-on-write fork, free), automatic prefix caching and device pools
sized to what the backend supports. Draft and target each get their own `KVPool`.

Prefix caching (vLLM's): a full block of committed tokens is named by a hash of its token
ids chained to its prefix's hash (`block_hashes`, SHA-256: a client cannot forge a
collision), and a later sequence whose tokens start the same adopts those blocks
read-only (`Sequence.adopt`). A cached block nobody holds stays cached until a new block
is needed; then the least recently freed goes first. A block that is about to be written
loses its name first (copy-on-write when someone else holds it)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence as Seq

import torch

from hal.errors import HalError, arg_error


def _count(name: str, v, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise arg_error(name, "a Python int", type(v).__name__)
    if v < lo:
        raise arg_error(name, f"an int >= {lo}", v)
    return v


def block_hashes(tokens: Seq[int], block_size: int, parent: bytes = b"", start: int = 0,
                 stop: int | None = None) -> list[bytes]:
    """The chained hashes of the full blocks ``start..stop-1`` of ``tokens`` (``parent``:
    block ``start - 1``'s hash, ``b""`` for the first block)."""
    stop = len(tokens) // block_size if stop is None else stop
    out = []
    for b in range(start, stop):
        h = hashlib.sha256(parent)
        h.update(b",".join(b"%d" % t for t in tokens[b * block_size:(b + 1) * block_size]))
        parent = h.digest()
        out.append(parent)
    return out


class BlockAllocator:
    """Reference-counted physical blocks ``0..num_blocks-1``, with a prefix cache when
    ``caching`` is on: full blocks named by `block_hashes`, kept after their last holder
    frees them (they count as free) and evicted least recently freed first.

    Every method is all or nothing: one that raises `HalError` has changed nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False):
        _count("num_blocks", num_blocks, 1)
        _count("block_size", block_size, 1)
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, bool(caching)
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._by_hash: dict[bytes, int] = {}      # a cached block's name -> the block
        self._hash_of: dict[int, bytes] = {}      # the inverse
        self._idle: OrderedDict[int, None] = OrderedDict()   # cached, unheld blocks, least recently freed first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a new allocation can take: never used, or cached and held by nobody."""
        return len(self._free) + len(self._idle)

    def _exhausted(self, need: int) -> HalError:
        return HalError(f"KV pool: expected {need} free block{'s' * (need != 1)}, got {self.num_free} of "
                        f"{self.num_blocks} (raise num_blocks or finish some sequences)")

    def allocate(self) -> int:
        """A fresh block (refcount 1): a never-used one, else the least recently freed cached one."""
        if self._free:
            b = self._free.pop()
        elif self._idle:
            b, _ = self._idle.popitem(last=False)
            del self._by_hash[self._hash_of.pop(b)]
            self.evictions += 1
        else:
            raise self._exhausted(1)
        self.refcount[b] = 1
        return b

    # -- the prefix cache ------------------------------------------------------------------------

    def cache(self, b: int, h: bytes) -> None:
        """Name live block ``b`` by ``h`` (its tokens are committed and will not change)
        unless caching is off, the name is taken or ``b`` already has one."""
        self._live(b)
        if self.caching and h not in self._by_hash and b not in self._hash_of:
            self._by_hash[h], self._hash_of[b] = b, h

    def uncache(self, b: int) -> None:
        """Drop live block ``b``'s name: it is about to be written."""
        self._live(b)
        if (h := self._hash_of.pop(b, None)) is not None:
            del self._by_hash[h]

    def cached(self, b: int) -> bool:
        return b in self._hash_of

    def match(self, hashes: Seq[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (changes nothing)."""
        out = []
        for h in hashes if self.caching else ():
            if (b := self._by_hash.get(h)) is None:
                break
            out.append(b)
        return out

    def acquire(self, b: int) -> None:
        """Hold cached block ``b`` once more (reviving it when nobody held it)."""
        if isinstance(b, bool) or not isinstance(b, int) or b not in self._hash_of:
            raise arg_error("block", "a cached block id", b)
        self._idle.pop(b, None)
        self.refcount[b] += 1

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
            if b in self._hash_of:
                self._idle[b] = None
            else:
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
        self.hashes: list[bytes] = []   # the names of the leading full blocks offered to the cache
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
        written = range(self.length // bs, min(need, len(self.blocks)))
        shared = [bi for bi in written if a.refcount[self.blocks[bi]] > 1]
        wanted = max(0, need - len(self.blocks)) + len(shared)
        if wanted > a.num_free:
            raise a._exhausted(wanted)
        for bi in written:   # a block about to be written is no longer what its name says
            if a.refcount[self.blocks[bi]] == 1:
                a.uncache(self.blocks[bi])
        del self.hashes[self.length // bs:]
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
        del self.hashes[length // self.block_size:]

    def adopt(self, hashes: Seq[bytes]) -> int:
        """Start an empty sequence on the cached blocks of the longest prefix of ``hashes``
        (held read-only; a later write copies). Returns the tokens it now holds."""
        self._alive("adopt")
        if self.blocks or self.length:
            raise HalError(f"Sequence.adopt: expected an empty sequence, got one holding {self.length} tokens",
                           arg="sequence", expected="an empty sequence", got=f"{self.length} tokens")
        found = self.allocator.match(hashes)
        for b in found:
            self.allocator.acquire(b)
        self.blocks, self.hashes = list(found), list(hashes[:len(found)])
        self.length = len(found) * self.block_size
        return self.length

    def cache_full_blocks(self, tokens: Seq[int]) -> None:
        """Offer every full block of committed tokens to the prefix cache; ``tokens`` are
        the token ids at positions ``0..`` (only those within ``length`` count)."""
        self._alive("cache_full_blocks")
        a, bs = self.allocator, self.block_size
        stop = min(self.length, len(tokens)) // bs
        if not a.caching or stop <= len(self.hashes):
            return
        new = block_hashes(tokens, bs, self.hashes[-1] if self.hashes else b"", len(self.hashes), stop)
        self.name_blocks(self.hashes + new, stop * bs)

    def name_blocks(self, names: Seq[bytes], upto: int) -> None:
        """Offer the leading full blocks within the first ``upto`` positions to the prefix
        cache under ``names`` (computed elsewhere from the same tokens: another pool's names)."""
        self._alive("name_blocks")
        stop = min(len(names), min(upto, self.length) // self.block_size)
        for bi in range(len(self.hashes), stop if self.allocator.caching else 0):
            self.allocator.cache(self.blocks[bi], names[bi])
            self.hashes.append(names[bi])

    def fork(self) -> "Sequence":
        """A child sharing every block (copy-on-write on its next write)."""
        self._alive("fork")
        child = Sequence(self.allocator)
        child.blocks, child.length, child.hashes = list(self.blocks), self.length, list(self.hashes)
        for b in child.blocks:
            self.allocator.incref(b)
        return child

    def free(self) -> None:
        """Return every block, the last first (vLLM's order: of its cached blocks the first is
        evicted last, and a later request can only use a prefix); the sequence is dead afterwards
        (freeing twice raises)."""
        self._alive("free")
        for b in self.blocks:
            self.allocator._live(b)
        for b in reversed(self.blocks):
            self.allocator.decref(b)
        self.blocks, self.hashes, self.length, self.reserved, self.freed = [], [], 0, 0, True


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
                 dtype: torch.dtype = torch.float32, num_layers: int = 1, device: str | None = None,
                 prefix_caching: bool = False):
        _count("num_blocks", num_blocks, 1)
        if block_size not in backend.spec.block_sizes:
            raise arg_error("block_size", f"{backend.spec.block_sizes} for backend {backend.name}", block_size)
        if _count("head_dim", head_dim, 1) % backend.spec.head_dim_align:
            raise arg_error("head_dim", f"a multiple of {backend.spec.head_dim_align} for backend {backend.name}",
                            head_dim)
        for name, v in (("num_kv_heads", num_kv_heads), ("num_layers", num_layers)):
            _count(name, v, 1)
        self.backend, self.allocator = backend, BlockAllocator(num_blocks, block_size, prefix_caching)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        dev = device or backend.device_type
        self.k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(num_layers)]

    def sequence(self) -> Sequence:
        return Sequence(self.allocator)
