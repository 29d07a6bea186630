from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import (TREE_ACCEPT, TREE_FINAL, dense, launch_rows, load_requests, race_update, row_argmax,
                                   uniform, unit_stride, verify_outputs)


@triton.jit
def _load_s_q(res_ptr, r, q_ptr, stride_q, node, x, cm, fresh, cols, V, HAS_Q: tl.constexpr):
    """A vocabulary tile of the stored residual (rows not fresh) and of the node's q (one-hot without draft probs)."""
    s = tl.load(res_ptr + r.to(tl.int64)[:, None] * V + cols[None, :], mask=cm & ~fresh[:, None], other=0.0)
    if HAS_Q:
        q = tl.load(q_ptr + node[:, None] * stride_q + cols[None, :], mask=cm, other=0.0).to(tl.float32)
    else:
        q = (cols[None, :] == x[:, None]).to(tl.float32)
    return s, q


@triton.jit
def _verify_tree_kernel(draft_ptr, cu_ptr, parent_ptr, t_ptr, stride_t, q_ptr, stride_q, seed_ptr, offset_ptr,
                        res_ptr, out_ptr, nodes_ptr, nacc_ptr, R, V, max_k, NPROG, GREEDY: tl.constexpr,
                        HAS_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # Sweep nodes in index order; node i is tried iff its parent is the current node.
    # Greedy: accept iff x == argmax of the current row. Sampling: accept iff u*q(x) < r(x); on a
    # rejection r <- norm(max(r - q, 0)) (p if zero), kept in res_ptr; `fresh` means r == p(row).
    pid = tl.program_id(0)
    for r0 in range(pid * BLOCK_R, R, NPROG * BLOCK_R):
        r, rm, start, k = load_requests(cu_ptr, r0, R, BLOCK_R)
        if not GREEDY:
            seed = tl.load(seed_ptr + r, mask=rm, other=0)
            offset = tl.load(offset_ptr + r, mask=rm, other=0)
        cur = tl.full([BLOCK_R], -1, tl.int64)
        row = start + r
        depth = tl.zeros([BLOCK_R], tl.int32)
        fresh = rm
        for i in range(0, max_k):
            act = rm & (i < k)
            par = tl.load(parent_ptr + start + i, mask=act, other=-2).to(tl.int64)
            tried = act & (par == cur)
            x = tl.load(draft_ptr + start + i, mask=tried, other=0).to(tl.int64)
            if GREEDY:
                _, arg = row_argmax(t_ptr, stride_t, row, tried, V, BLOCK_R, BLOCK_V)
                acc = tried & (x == arg)
            else:
                p_x = tl.load(t_ptr + row * stride_t + x, mask=tried & fresh, other=0.0).to(tl.float32)
                s_x = tl.load(res_ptr + r.to(tl.int64) * V + x, mask=tried & ~fresh, other=0.0)
                if HAS_Q:
                    q_x = tl.load(q_ptr + (start + i) * stride_q + x, mask=tried, other=1.0).to(tl.float32)
                else:
                    q_x = tl.full([BLOCK_R], 1.0, tl.float32)
                u = uniform(seed, offset, TREE_ACCEPT, tl.zeros([BLOCK_R], tl.int32) + i)
                acc = tried & (u * q_x < tl.where(fresh, p_x, s_x))
                rej = tried & ~acc
                total = tl.zeros([BLOCK_R], tl.float32)
                for v0 in range(0, V, BLOCK_V):
                    cols = v0 + tl.arange(0, BLOCK_V)
                    cm = rej[:, None] & (cols < V)[None, :]
                    p = tl.load(t_ptr + row[:, None] * stride_t + cols[None, :], mask=cm & fresh[:, None],
                                other=0.0).to(tl.float32)
                    s, q = _load_s_q(res_ptr, r, q_ptr, stride_q, start + i, x, cm, fresh, cols, V, HAS_Q)
                    total += tl.sum(tl.maximum(tl.where(fresh[:, None], p, s) - q, 0.0), 1)
                for v0 in range(0, V, BLOCK_V):
                    cols = v0 + tl.arange(0, BLOCK_V)
                    cm = rej[:, None] & (cols < V)[None, :]
                    p = tl.load(t_ptr + row[:, None] * stride_t + cols[None, :], mask=cm, other=0.0).to(tl.float32)
                    s, q = _load_s_q(res_ptr, r, q_ptr, stride_q, start + i, x, cm, fresh, cols, V, HAS_Q)
                    rest = tl.maximum(tl.where(fresh[:, None], p, s) - q, 0.0)
                    new = tl.where((total > 0.0)[:, None], rest / tl.maximum(total, 1e-30)[:, None], p)
                    tl.store(res_ptr + r.to(tl.int64)[:, None] * V + cols[None, :], new, mask=cm)
                fresh = fresh & ~rej
            tl.store(out_ptr + r * (max_k + 1) + depth, x.to(tl.int32), mask=acc)
            tl.store(nodes_ptr + r * max_k + depth, tl.zeros([BLOCK_R], tl.int32) + i, mask=acc)
            depth += acc.to(tl.int32)
            cur = tl.where(acc, i, cur)
            row = tl.where(acc, start + r + 1 + i, row)
            fresh = fresh | acc
        if GREEDY:
            _, arg = row_argmax(t_ptr, stride_t, row, rm, V, BLOCK_R, BLOCK_V)
        else:
            best = tl.full([BLOCK_R], -2.0, tl.float32)
            arg = tl.zeros([BLOCK_R], tl.int32)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                cm = rm[:, None] & (cols < V)[None, :]
                p = tl.load(t_ptr + row[:, None] * stride_t + cols[None, :], mask=cm & fresh[:, None],
                            other=0.0).to(tl.float32)
                s = tl.load(res_ptr + r.to(tl.int64)[:, None] * V + cols[None, :], mask=cm & ~fresh[:, None],
                            other=0.0)
                best, arg = race_update(best, arg, tl.where(fresh[:, None], p, s), seed, offset, TREE_FINAL,
                                        cols, cols < V)
        tl.store(out_ptr + r * (max_k + 1) + depth, arg, mask=rm)
        tl.store(nacc_ptr + r, depth, mask=rm)


def verify_tree(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor, target: Tensor,
                draft_probs: Tensor | None, seeds: Tensor | None, offsets: Tensor | None,
                max_k: int) -> tuple[Tensor, Tensor, Tensor]:
    R, V = cu_num_draft_tokens.shape[0] - 1, target.shape[1]
    target, draft_probs = unit_stride(target), unit_stride(draft_probs)
    draft_token_ids, cu_num_draft_tokens, parent_ids, seeds, offsets = dense(
        draft_token_ids, cu_num_draft_tokens, parent_ids, seeds, offsets)
    dev = target.device
    out, n_acc = verify_outputs(R, max_k, dev)
    nodes = torch.full((R, max_k), -1, dtype=torch.int32, device=dev)
    if R:
        greedy = seeds is None
        residual = target if greedy else torch.empty(R, V, dtype=torch.float32, device=dev)
        q = draft_probs if draft_probs is not None else target
        launch_rows(_verify_tree_kernel, R, V, dev, draft_token_ids, cu_num_draft_tokens, parent_ids, target,
                    target.stride(0), q, q.stride(0), seeds if not greedy else cu_num_draft_tokens,
                    offsets if not greedy else cu_num_draft_tokens, residual, out, nodes, n_acc, R, V, max_k,
                    GREEDY=greedy, HAS_Q=draft_probs is not None)
    return out, nodes, n_acc
