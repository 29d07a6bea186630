from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import SAMPLE, argmax_update, dense, launch_rows, race_update, unit_stride
from hal.ops import SAMPLING_EPS

EPS = tl.constexpr(SAMPLING_EPS)


@triton.jit
def _key(z):
    # Order-preserving map fp32 -> int32 (as int64); +0.0 folds -0.0 into 0.0.
    bits = (z + 0.0).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _z_tile(logits_ptr, stride_l, row, cols, mask, xmax, inv_t):
    """A [rows, vocab] tile of z = (logits - max) / T in fp32 (-inf where masked); <= 0, never overflows."""
    return (tl.load(logits_ptr + row[:, None] * stride_l + cols[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32) - xmax[:, None]) * inv_t[:, None]


@triton.jit
def _sample_kernel(logits_ptr, stride_l, temp_ptr, topk_ptr, topp_ptr, seed_ptr, offset_ptr, tok_ptr, q_ptr,
                   R, V, K_ITERS, P_ITERS, NPROG, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # z = (logits - max) / T. Cutoffs found by bisection on the order-preserving int key of z, so no
    # vocabulary sort: top-k keeps key >= the k-th largest key; top-p keeps key >= the smallest
    # key t with mass(z > t) < top_p * mass(top-k set). q = softmax over the kept set; the token
    # is an exponential race over q. T < SAMPLING_EPS: q = one_hot(argmax logits).
    pid = tl.program_id(0)
    for r0 in range(pid * BLOCK_R, R, NPROG * BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rm = r < R
        row = r.to(tl.int64)
        t = tl.load(temp_ptr + r, mask=rm, other=1.0)
        greedy = t < EPS
        inv_t = 1.0 / tl.where(greedy, 1.0, t)
        top_k = tl.load(topk_ptr + r, mask=rm, other=0).to(tl.int64)
        top_p = tl.load(topp_ptr + r, mask=rm, other=1.0)
        use_k = rm & ~greedy & (top_k >= 1) & (top_k < V)
        use_p = rm & ~greedy & (top_p < 1.0)
        zmax = tl.full([BLOCK_R], float("-inf"), tl.float32)
        top = tl.zeros([BLOCK_R], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(logits_ptr + row[:, None] * stride_l + cols[None, :],
                        mask=rm[:, None] & (cols < V)[None, :], other=float("-inf")).to(tl.float32)
            zmax, top = argmax_update(zmax, top, x, cols)
        xmax = tl.where(rm & (zmax > float("-inf")), zmax, 0.0)  # z = (x - xmax) / T <= 0: exp(z) never overflows
        # top-k: the largest key c with count(key >= c) >= k
        lo = tl.full([BLOCK_R], -2147483648, tl.int64)
        hi = tl.full([BLOCK_R], 2147483648, tl.int64)
        for _ in range(0, K_ITERS):
            mid = (lo + hi) >> 1
            cnt = tl.zeros([BLOCK_R], tl.int64)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                cm = use_k[:, None] & (cols < V)[None, :]
                z = _z_tile(logits_ptr, stride_l, row, cols, cm, xmax, inv_t)
                cnt += tl.sum((cm & (_key(z) >= mid[:, None])).to(tl.int64), 1)
            ok = cnt >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        cut = tl.where(use_k, lo, -2147483649)
        mass_k = tl.zeros([BLOCK_R], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cm = use_p[:, None] & (cols < V)[None, :]
            z = _z_tile(logits_ptr, stride_l, row, cols, cm, xmax, inv_t)
            mass_k += tl.sum(tl.where(cm & (_key(z) >= cut[:, None]), tl.exp(z), 0.0), 1)
        # top-p: the smallest key c with mass(key > c) < top_p * mass_k
        lo = tl.full([BLOCK_R], -2147483649, tl.int64)
        hi = tl.full([BLOCK_R], 2147483647, tl.int64)
        for _ in range(0, P_ITERS):
            mid = (lo + hi) >> 1
            mass = tl.zeros([BLOCK_R], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                cm = use_p[:, None] & (cols < V)[None, :]
                z = _z_tile(logits_ptr, stride_l, row, cols, cm, xmax, inv_t)
                kz = _key(z)
                mass += tl.sum(tl.where(cm & (kz > mid[:, None]) & (kz >= cut[:, None]),
                                        tl.exp(z), 0.0), 1)
            ok = mass < top_p * mass_k
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        cut = tl.where(use_p, tl.maximum(cut, hi), cut)
        total = tl.zeros([BLOCK_R], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cm = rm[:, None] & (cols < V)[None, :]
            z = _z_tile(logits_ptr, stride_l, row, cols, cm, xmax, inv_t)
            total += tl.sum(tl.where(cm & (_key(z) >= cut[:, None]), tl.exp(z), 0.0), 1)
        total = tl.where(total > 0.0, total, 1.0)  # padding rows
        seed = tl.load(seed_ptr + r, mask=rm, other=0)
        offset = tl.load(offset_ptr + r, mask=rm, other=0)
        best = tl.full([BLOCK_R], -2.0, tl.float32)
        pick = tl.zeros([BLOCK_R], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cm = rm[:, None] & (cols < V)[None, :]
            z = _z_tile(logits_ptr, stride_l, row, cols, cm, xmax, inv_t)
            q = tl.where(_key(z) >= cut[:, None], tl.exp(z), 0.0) / total[:, None]
            q = tl.where(greedy[:, None], (cols[None, :] == top[:, None]).to(tl.float32), q)
            tl.store(q_ptr + row[:, None] * V + cols[None, :], q, mask=cm)
            best, pick = race_update(best, pick, q, seed, offset, SAMPLE, cols, cols < V)
        tl.store(tok_ptr + r, tl.where(greedy, top, pick), mask=rm)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
           offsets: Tensor) -> tuple[Tensor, Tensor]:
    R, V = logits.shape
    logits = unit_stride(logits)
    temperature, top_k, top_p, seeds, offsets = dense(temperature, top_k, top_p, seeds, offsets)
    dev = logits.device
    tokens = torch.empty(R, dtype=torch.int32, device=dev)
    q = torch.empty(R, V, dtype=torch.float32, device=dev)
    if R:
        # Skip the bisections when no row needs them; free to know on host tensors, else always run.
        on_host = dev.type == "cpu"
        k_iters = 32 if not on_host or bool(((top_k >= 1) & (top_k < V) & (temperature >= SAMPLING_EPS)).any()) else 0
        p_iters = 32 if not on_host or bool(((top_p < 1) & (temperature >= SAMPLING_EPS)).any()) else 0
        launch_rows(_sample_kernel, R, V, dev, logits, logits.stride(0), temperature, top_k, top_p, seeds, offsets,
                    tokens, q, R, V, k_iters, p_iters)
    return tokens, q
