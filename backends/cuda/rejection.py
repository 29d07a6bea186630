from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import (ACCEPT, RECOVER, dense, launch_rows, load_requests, race_update, uniform, unit_stride,
                                   verify_outputs)


@triton.jit
def _load_p_q(p_ptr, stride_p, row, q_ptr, stride_q, qrow, x_rej, rm, rej, cols, V, HAS_Q: tl.constexpr):
    """A vocabulary tile of p (target row) and q (draft row at the rejection; one-hot without draft probs)."""
    cm = rm[:, None] & (cols < V)[None, :]
    p = tl.load(p_ptr + row[:, None] * stride_p + cols[None, :], mask=cm, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(q_ptr + qrow[:, None] * stride_q + cols[None, :], mask=cm & rej[:, None], other=0.0).to(tl.float32)
    else:
        q = (cols[None, :] == x_rej[:, None]).to(tl.float32)
    return p, q


@triton.jit
def _verify_rejection_kernel(draft_ptr, cu_ptr, q_ptr, stride_q, p_ptr, stride_p, seed_ptr, offset_ptr,
                             out_ptr, nacc_ptr, R, V, max_k, NPROG, HAS_Q: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # Accept x_j iff u_j * q_j(x_j) < p_j(x_j) (q one-hot without draft probs). The last token
    # is an exponential race over w = max(p - q, 0) at the first rejection (p if w == 0),
    # or over p at the bonus row. Vocabulary in tiles: no [R, V] noise is materialised.
    pid = tl.program_id(0)
    for r0 in range(pid * BLOCK_R, R, NPROG * BLOCK_R):
        r, rm, start, k = load_requests(cu_ptr, r0, R, BLOCK_R)
        seed = tl.load(seed_ptr + r, mask=rm, other=0)
        offset = tl.load(offset_ptr + r, mask=rm, other=0)
        alive = rm
        n = tl.zeros([BLOCK_R], tl.int32)
        for j in range(0, max_k):
            act = alive & (j < k)
            x = tl.load(draft_ptr + start + j, mask=act, other=0).to(tl.int64)
            p_x = tl.load(p_ptr + (start + r + j) * stride_p + x, mask=act, other=0.0).to(tl.float32)
            if HAS_Q:
                q_x = tl.load(q_ptr + (start + j) * stride_q + x, mask=act, other=1.0).to(tl.float32)
            else:
                q_x = tl.full([BLOCK_R], 1.0, tl.float32)
            u = uniform(seed, offset, ACCEPT, tl.zeros([BLOCK_R], tl.int32) + j)
            alive = act & (u * q_x < p_x)
            tl.store(out_ptr + r * (max_k + 1) + j, x.to(tl.int32), mask=alive)
            n += alive.to(tl.int32)
        rej = rm & (n < k)
        row = start + r + n
        qrow = start + n
        x_rej = tl.load(draft_ptr + qrow, mask=rej, other=-1)
        total = tl.zeros([BLOCK_R], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            p, q = _load_p_q(p_ptr, stride_p, row, q_ptr, stride_q, qrow, x_rej, rm, rej, cols, V, HAS_Q)
            total += tl.sum(tl.where(rej[:, None], tl.maximum(p - q, 0.0), p), 1)
        use_p = total <= 0.0
        best = tl.full([BLOCK_R], -2.0, tl.float32)
        arg = tl.zeros([BLOCK_R], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            p, q = _load_p_q(p_ptr, stride_p, row, q_ptr, stride_q, qrow, x_rej, rm, rej, cols, V, HAS_Q)
            w = tl.where((rej & ~use_p)[:, None], tl.maximum(p - q, 0.0), p)
            best, arg = race_update(best, arg, w, seed, offset, RECOVER, cols, cols < V)
        tl.store(out_ptr + r * (max_k + 1) + n, arg, mask=rm)
        tl.store(nacc_ptr + r, n, mask=rm)


def verify_rejection(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
                     target_probs: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    R, V = cu_num_draft_tokens.shape[0] - 1, target_probs.shape[1]
    target_probs, draft_probs = unit_stride(target_probs), unit_stride(draft_probs)
    draft_token_ids, cu_num_draft_tokens, seeds, offsets = dense(draft_token_ids, cu_num_draft_tokens, seeds, offsets)
    out, n_acc = verify_outputs(R, max_k, target_probs.device)
    if R:
        q = draft_probs if draft_probs is not None else target_probs
        launch_rows(_verify_rejection_kernel, R, V, target_probs.device, draft_token_ids, cu_num_draft_tokens, q,
                    q.stride(0), target_probs, target_probs.stride(0), seeds, offsets, out, n_acc, R, V, max_k,
                    HAS_Q=draft_probs is not None)
    return out, n_acc
