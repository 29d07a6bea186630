"""Shared parts of the cuda backend: launch geometry and small @triton.jit helpers.

Portable to triton-ascend: 1-D grids capped at a core count with a loop inside,
no fp64 in kernels, argmax on fp32 values.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.random import uint_to_uniform_float

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Random streams, one per use, as in verify_ops: draws never collide across ops. A compiled kernel
# reads a module global only as tl.constexpr (a plain int fails to compile on a GPU); the
# interpreter runs kernels as Python and wants the plain int (its constexpr lacks tensor arithmetic).
SAMPLE, ACCEPT, RECOVER, TYPICAL_BONUS, TREE_ACCEPT, TREE_FINAL = (i if INTERPRET else tl.constexpr(i) for i in range(1, 7))


def num_programs(work_items: int, device: torch.device) -> int:
    """Programs to launch: one per work item, capped at a few per core (SM)."""
    cap = 2 if INTERPRET or device.type != "cuda" else 4 * _sm_count(device.index)  # the interpreter pays per program
    return max(1, min(work_items, cap))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


def row_tiles(R: int, V: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_V): a [rows, vocab] tile; wide rows on a GPU, many rows when V is small."""
    budget = 65536 if INTERPRET else 4096
    block_v = min(triton.next_power_of_2(max(V, 1)), 1024 if not INTERPRET else 4096)
    if not INTERPRET:  # Triton 3.6 fails to compile the tree kernel at [8, 1..4] tiles (layout pass)
        block_v = max(block_v, 16)
    block_r = max(1, min(triton.next_power_of_2(max(R, 1)), budget // block_v))
    return block_r, block_v


def launch_rows(kernel, R: int, V: int, device: torch.device, *args, **constexprs) -> None:
    """Launch a row-blocked kernel: ``kernel(*args, NPROG, BLOCK_R=, BLOCK_V=, **constexprs)``."""
    block_r, block_v = row_tiles(R, V)
    n = num_programs(triton.cdiv(R, block_r), device)
    kernel[(n,)](*args, n, BLOCK_R=block_r, BLOCK_V=block_v, **constexprs)


def verify_outputs(R: int, max_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R, max_k+1] int32 filled with -1, num_accepted [R] int32)."""
    return (torch.full((R, max_k + 1), -1, dtype=torch.int32, device=device),
            torch.zeros(R, dtype=torch.int32, device=device))


@triton.jit
def load_requests(cu_ptr, r0, R, BLOCK_R: tl.constexpr):
    """A block of requests from r0: (r, in range, first draft index, number of drafts)."""
    r = r0 + tl.arange(0, BLOCK_R)
    rm = r < R
    start = tl.load(cu_ptr + r, mask=rm, other=0).to(tl.int64)
    k = tl.load(cu_ptr + r + 1, mask=rm, other=0).to(tl.int64) - start
    return r, rm, start, k


@triton.jit
def uniform(seed, offset, stream: tl.constexpr, idx):
    """U[0, 1) from Philox (tl.rand) keyed by the request's (seed, offset)."""
    key = seed ^ (offset * -7046029254386353131)
    return tl.rand(key, stream * 16777216 + idx)


@triton.jit
def argmax_update(best_val, best_idx, vals, cols):
    """Fold a [BR, BV] fp32 tile into running (max, argmax); ties keep the lowest id."""
    tile_max = tl.max(vals, 1)
    tile_idx = tl.min(tl.where(vals == tile_max[:, None], cols[None, :], 2147483647), 1)
    better = tile_max > best_val
    return tl.where(better, tile_max, best_val), tl.where(better, tile_idx, best_idx)


@triton.jit
def row_argmax(ptr, stride, row, mask, V, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Argmax (fp32, lowest id on ties) of row ``row[i]`` of a [*, V] tensor, for rows where ``mask``."""
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_R], tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + row[:, None] * stride + cols[None, :], mask=mask[:, None] & (cols < V)[None, :],
                    other=float("-inf")).to(tl.float32)
        best, arg = argmax_update(best, arg, x, cols)
    return best, arg


@triton.jit
def exponential(seed, offset, stream: tl.constexpr, idx):
    """E ~ Exp(1) as -log1p(-u), u from two 31-bit Philox draws (fine down to ~2e-19).

    A long-tail token (weight w << the largest) wins the race only when its E is tiny;
    -log(u) with a float32 u <= 1 - 2^-24 never goes below 6e-8 and silently drops it.
    log1p is Kahan's form (float32, no libdevice): exact where 1 - u rounds to 1."""
    key = seed ^ (offset * -7046029254386353131)
    a, b, _, _ = tl.randint4x(key, stream * 16777216 + idx)
    u = uint_to_uniform_float(a) + uint_to_uniform_float(b) * 4.6566127342e-10
    u = tl.minimum(tl.maximum(u, 1e-30), 0.99999994)
    w = 1.0 - u
    exact = w == 1.0
    return tl.where(exact, u, -tl.log(w) * (u / tl.where(exact, 1.0, 1.0 - w)))


@triton.jit
def race_update(best_score, best_idx, w, seed, offset, stream: tl.constexpr, cols, col_mask):
    """Exponential race: argmax_v w_v / E_v, E_v ~ Exp(1), samples v with prob. w_v / sum(w)."""
    e = exponential(seed[:, None], offset[:, None], stream, cols[None, :])
    score = tl.where(col_mask[None, :], w / e, -1.0)
    return argmax_update(best_score, best_idx, score, cols)


@triton.jit
def _copy_rows_kernel(src_ptr, src_idx_ptr, src_bs, src_s0, src_s1,
                      dst_ptr, dst_idx_ptr, dst_bs, dst_s0, dst_s1,
                      M, HD, NPROG, BLOCK_M: tl.constexpr, BLOCK_HD: tl.constexpr):
    # Row m goes from src slot idx[m] to dst slot idx[m]; slot s = (s // bs, s % bs); -1 skips.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_HD)
    for m0 in range(pid * BLOCK_M, M, NPROG * BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        mm = m < M
        s = tl.load(src_idx_ptr + m, mask=mm, other=-1).to(tl.int64)
        d = tl.load(dst_idx_ptr + m, mask=mm, other=-1).to(tl.int64)
        ok = mm & (s >= 0) & (d >= 0)
        for c0 in range(0, HD, BLOCK_HD):
            c = c0 + cols
            cm = ok[:, None] & (c < HD)[None, :]
            x = tl.load(src_ptr + ((s // src_bs) * src_s0 + (s % src_bs) * src_s1)[:, None] + c[None, :], mask=cm)
            tl.store(dst_ptr + ((d // dst_bs) * dst_s0 + (d % dst_bs) * dst_s1)[:, None] + c[None, :],
                     x.to(dst_ptr.dtype.element_ty), mask=cm)


def copy_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """Copy rows between tensors viewed as [blocks, block_size, H*D] (a 2-D tensor is one block of rows)."""
    def geom(t):
        if t.dim() == 2:
            return t.shape[0], t.stride(0) * t.shape[0], t.stride(0)
        return t.shape[1], t.stride(0), t.stride(1)
    M, HD = src_idx.shape[0], src.shape[-1] * (src.shape[-2] if src.dim() == 4 else 1)
    if M == 0:
        return
    block_hd = min(triton.next_power_of_2(HD), 1024)
    block_m = max(1, min(triton.next_power_of_2(M), (16384 if INTERPRET else 4096) // block_hd))
    n = num_programs(triton.cdiv(M, block_m), src.device)
    _copy_rows_kernel[(n,)](src, src_idx, *geom(src), dst, dst_idx, *geom(dst), M, HD, n,
                            BLOCK_M=block_m, BLOCK_HD=block_hd)


def packed_heads(t: torch.Tensor) -> bool:
    """[..., H, D] with D contiguous and H packed right above it (a row of H*D values)."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def in_place(fn, *caches: torch.Tensor) -> None:
    """Run ``fn(*caches)`` on packed-heads caches: the caches themselves when they are
    (the usual layout), else packed copies that are written back (any strides accepted)."""
    if all(packed_heads(c) for c in caches):
        fn(*caches)
        return
    work = [c if packed_heads(c) else c.contiguous() for c in caches]
    fn(*work)
    for c, w in zip(caches, work):
        if w is not c:
            c.copy_(w)


def dense(*ts: torch.Tensor | None):
    """Contiguous index/parameter tensors (a copy only when one is not): kernels read
    1-D and [R, W] arguments with unit strides. None passes through."""
    out = tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in ts)
    return out if len(out) > 1 else out[0]


def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """Rows with a unit last stride (a copy only when they are not)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()
