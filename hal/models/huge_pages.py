"""Weights in transparent huge pages where the kernel allows it.

A decode streams every weight once per token, so it runs at the memory's rate, and that rate
depends on the page size: with 4 KB pages a core's prefetchers stop at every page boundary
and its TLB misses every 4 KB. llama.cpp maps its file, which the page cache may hold in huge
pages; our packed tiles are anonymous memory, 4 KB pages unless asked
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most distributions).
`resident` copies a packed weight into a 2 MB-aligned buffer marked ``MADV_HUGEPAGE`` before
it is written: a fresh allocation (the large ones are fresh mappings) gets huge pages at its
first touch; memory the allocator reuses is left to the kernel's background collapse. The hint changes no value: where
the kernel refuses it or the platform has no ``madvise`` (not Linux), the copy is a plain one
(benchmarks/q4q8_stream.py measures the difference)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch
from torch import Tensor

HUGE = 2 << 20          # a transparent huge page on x86-64 and most arm64 kernels
MADV_HUGEPAGE = 14      # linux/mman.h
MIN_BYTES = 4 * HUGE    # smaller weights gain little and would waste up to a page each


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = getattr(libc, "madvise", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def resident(t: Tensor) -> Tensor:
    """``t`` (a contiguous CPU tensor), copied into memory advised as huge pages when it is at
    least `MIN_BYTES`; else ``t`` itself. The copy has ``t``'s shape, dtype and values."""
    if _MADVISE is None or t.device.type != "cpu" or t.nbytes < MIN_BYTES:
        return t
    raw = torch.empty(t.nbytes + HUGE, dtype=torch.uint8)   # not yet touched: no page is faulted in
    start = -raw.data_ptr() % HUGE
    _MADVISE(raw.data_ptr() + start, t.nbytes - t.nbytes % HUGE, MADV_HUGEPAGE)   # a hint: its result is not needed
    out = raw[start:start + t.nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
