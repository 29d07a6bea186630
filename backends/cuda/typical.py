from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import (TYPICAL_BONUS, argmax_update, dense, launch_rows, load_requests, race_update, unit_stride,
                                   verify_outputs)


@triton.jit
def _verify_typical_kernel(draft_ptr, cu_ptr, p_ptr, stride_p, seed_ptr, offset_ptr, out_ptr, nacc_ptr,
                           R, V, max_k, eps, delta, NPROG, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # LOSSY: accept x_j iff p_j(x_j) > min(eps, delta * exp(-H(p_j))). First rejection: argmax p_j;
    # all accepted: the bonus token races over p_k.
    pid = tl.program_id(0)
    for r0 in range(pid * BLOCK_R, R, NPROG * BLOCK_R):
        r, rm, start, k = load_requests(cu_ptr, r0, R, BLOCK_R)
        alive = rm
        n = tl.zeros([BLOCK_R], tl.int32)
        for j in range(0, max_k):
            act = alive & (j < k)
            row = start + r + j
            h = tl.zeros([BLOCK_R], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                p = tl.load(p_ptr + row[:, None] * stride_p + cols[None, :],
                            mask=act[:, None] & (cols < V)[None, :], other=0.0).to(tl.float32)
                h -= tl.sum(p * tl.log(tl.maximum(p, 1e-30)), 1)
            x = tl.load(draft_ptr + start + j, mask=act, other=0).to(tl.int64)
            p_x = tl.load(p_ptr + row * stride_p + x, mask=act, other=0.0).to(tl.float32)
            alive = act & (p_x > tl.minimum(eps, delta * tl.exp(-h)))
            tl.store(out_ptr + r * (max_k + 1) + j, x.to(tl.int32), mask=alive)
            n += alive.to(tl.int32)
        seed = tl.load(seed_ptr + r, mask=rm, other=0)
        offset = tl.load(offset_ptr + r, mask=rm, other=0)
        row = start + r + n
        top = tl.full([BLOCK_R], float("-inf"), tl.float32)
        top_arg = tl.zeros([BLOCK_R], tl.int32)
        best = tl.full([BLOCK_R], -2.0, tl.float32)
        pick = tl.zeros([BLOCK_R], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            cm = rm[:, None] & (cols < V)[None, :]
            p = tl.load(p_ptr + row[:, None] * stride_p + cols[None, :], mask=cm, other=float("-inf")).to(tl.float32)
            top, top_arg = argmax_update(top, top_arg, p, cols)
            best, pick = race_update(best, pick, tl.maximum(p, 0.0), seed, offset, TYPICAL_BONUS, cols, cols < V)
        tl.store(out_ptr + r * (max_k + 1) + n, tl.where(n < k, top_arg, pick), mask=rm)
        tl.store(nacc_ptr + r, n, mask=rm)


def verify_typical(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_probs: Tensor, seeds: Tensor,
                   offsets: Tensor, max_k: int, posterior_threshold: float,
                   posterior_alpha: float) -> tuple[Tensor, Tensor]:
    R, V = cu_num_draft_tokens.shape[0] - 1, target_probs.shape[1]
    target_probs = unit_stride(target_probs)
    draft_token_ids, cu_num_draft_tokens, seeds, offsets = dense(draft_token_ids, cu_num_draft_tokens, seeds, offsets)
    out, n_acc = verify_outputs(R, max_k, target_probs.device)
    if R:
        launch_rows(_verify_typical_kernel, R, V, target_probs.device, draft_token_ids, cu_num_draft_tokens,
                    target_probs, target_probs.stride(0), seeds, offsets, out, n_acc, R, V, max_k,
                    float(posterior_threshold), float(posterior_alpha))
    return out, n_acc
