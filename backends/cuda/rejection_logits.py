from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import (ACCEPT, RECOVER, argmax_update, dense, launch_rows, load_requests, race_update,
                                   uniform, unit_stride, verify_outputs)
from hal.ops import SAMPLING_EPS

EPS = tl.constexpr(SAMPLING_EPS)


@triton.jit
def _row_stats(l_ptr, stride_l, row, mask, inv_t, V, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """One pass over rows ``row`` (where ``mask``): (max, argmax (fp32, lowest id on ties),
    sum of exp((x - max) / T)), the sum rescaled online as the max grows (flash-attention style)."""
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_R], tl.int32)
    s = tl.zeros([BLOCK_R], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(l_ptr + row[:, None] * stride_l + cols[None, :], mask=mask[:, None] & (cols < V)[None, :],
                    other=float("-inf")).to(tl.float32)
        m_new, arg = argmax_update(m, arg, x, cols)
        safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.exp((m - safe) * inv_t) + tl.sum(tl.exp((x - safe[:, None]) * inv_t[:, None]), 1)
        m = m_new
    return m, arg, s


@triton.jit
def _p_q_tile(l_ptr, stride_l, row, m, inv_s, inv_t, q_ptr, stride_q, qrow, x_rej, live, rej, cols, V,
              HAS_Q: tl.constexpr):
    """A vocabulary tile of p = exp((x - max) / T) / s at each request's last row, and of q at its rejection."""
    cm = live[:, None] & (cols < V)[None, :]
    x = tl.load(l_ptr + row[:, None] * stride_l + cols[None, :], mask=cm, other=float("-inf")).to(tl.float32)
    p = tl.exp((x - m[:, None]) * inv_t[:, None]) * inv_s[:, None]
    if HAS_Q:
        q = tl.load(q_ptr + qrow[:, None] * stride_q + cols[None, :], mask=cm & rej[:, None], other=0.0).to(tl.float32)
    else:
        q = (cols[None, :] == x_rej[:, None]).to(tl.float32)
    return p, q


@triton.jit
def _verify_rejection_logits_kernel(draft_ptr, cu_ptr, q_ptr, stride_q, l_ptr, stride_l, temp_ptr, seed_ptr,
                                    offset_ptr, out_ptr, nacc_ptr, R, V, max_k, NPROG, HAS_Q: tl.constexpr,
                                    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # Draft j: one pass over its row gives (max, argmax, s); p(x) = exp((l_x - max) / T) / s.
    # Greedy (T < EPS): accept iff x == argmax; else iff u * q(x) < p(x). Rows after a request's
    # first rejection are never read. The last token: the argmax (greedy), else an exponential race
    # over max(p - q, 0) at the rejection (p if that is all zero) or over p at the bonus row,
    # whose stats are the only ones computed after the loop.
    pid = tl.program_id(0)
    for r0 in range(pid * BLOCK_R, R, NPROG * BLOCK_R):
        r, rm, start, k = load_requests(cu_ptr, r0, R, BLOCK_R)
        seed = tl.load(seed_ptr + r, mask=rm, other=0)
        offset = tl.load(offset_ptr + r, mask=rm, other=0)
        t = tl.load(temp_ptr + r, mask=rm, other=1.0)
        greedy = t < EPS
        inv_t = 1.0 / tl.where(greedy, 1.0, t)
        alive = rm
        n = tl.zeros([BLOCK_R], tl.int32)
        m_l = tl.zeros([BLOCK_R], tl.float32)
        arg_l = tl.zeros([BLOCK_R], tl.int32)
        s_l = tl.zeros([BLOCK_R], tl.float32)
        for j in range(0, max_k):
            act = alive & (j < k)
            row = start + r + j
            m, arg, s = _row_stats(l_ptr, stride_l, row, act, inv_t, V, BLOCK_R, BLOCK_V)
            x = tl.load(draft_ptr + start + j, mask=act, other=0).to(tl.int64)
            l_x = tl.load(l_ptr + row * stride_l + x, mask=act, other=float("-inf")).to(tl.float32)
            safe = tl.where(m > float("-inf"), m, 0.0)
            p_x = tl.exp((l_x - safe) * inv_t) / tl.maximum(s, 1.0)
            if HAS_Q:
                q_x = tl.load(q_ptr + (start + j) * stride_q + x, mask=act, other=1.0).to(tl.float32)
            else:
                q_x = tl.full([BLOCK_R], 1.0, tl.float32)
            u = uniform(seed, offset, ACCEPT, tl.zeros([BLOCK_R], tl.int32) + j)
            ok = act & tl.where(greedy, x == arg.to(tl.int64), u * q_x < p_x)
            stop = act & ~ok                     # the first rejection: its row's stats are the last row's
            m_l, arg_l, s_l = tl.where(stop, safe, m_l), tl.where(stop, arg, arg_l), tl.where(stop, s, s_l)
            tl.store(out_ptr + r * (max_k + 1) + j, x.to(tl.int32), mask=ok)
            n += ok.to(tl.int32)
            alive = ok
        rej = rm & (n < k)
        bonus = rm & ~rej
        row = start + r + n
        m, arg, s = _row_stats(l_ptr, stride_l, row, bonus, inv_t, V, BLOCK_R, BLOCK_V)
        m_l = tl.where(bonus, tl.where(m > float("-inf"), m, 0.0), m_l)
        arg_l, inv_s = tl.where(bonus, arg, arg_l), 1.0 / tl.maximum(tl.where(bonus, s, s_l), 1.0)
        live = rm & ~greedy                       # rows that draw their last token
        qrow = start + n
        x_rej = tl.load(draft_ptr + qrow, mask=rej, other=-1)
        total = tl.zeros([BLOCK_R], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            p, q = _p_q_tile(l_ptr, stride_l, row, m_l, inv_s, inv_t, q_ptr, stride_q, qrow, x_rej, live, rej, cols,
                             V, HAS_Q)
            total += tl.sum(tl.where(rej[:, None], tl.maximum(p - q, 0.0), p), 1)
        use_p = total <= 0.0
        best = tl.full([BLOCK_R], -2.0, tl.float32)
        drawn = tl.zeros([BLOCK_R], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            p, q = _p_q_tile(l_ptr, stride_l, row, m_l, inv_s, inv_t, q_ptr, stride_q, qrow, x_rej, live, rej, cols,
                             V, HAS_Q)
            w = tl.where((rej & ~use_p)[:, None], tl.maximum(p - q, 0.0), p)
            best, drawn = race_update(best, drawn, w, seed, offset, RECOVER, cols, cols < V)
        tl.store(out_ptr + r * (max_k + 1) + n, tl.where(greedy, arg_l, drawn), mask=rm)
        tl.store(nacc_ptr + r, n, mask=rm)


def verify_rejection_logits(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
                            target_logits: Tensor, temperature: Tensor, seeds: Tensor, offsets: Tensor,
                            max_k: int) -> tuple[Tensor, Tensor]:
    R, V = cu_num_draft_tokens.shape[0] - 1, target_logits.shape[1]
    target_logits, draft_probs = unit_stride(target_logits), unit_stride(draft_probs)
    draft_token_ids, cu_num_draft_tokens, temperature, seeds, offsets = dense(
        draft_token_ids, cu_num_draft_tokens, temperature, seeds, offsets)
    out, n_acc = verify_outputs(R, max_k, target_logits.device)
    if R:
        q = draft_probs if draft_probs is not None else target_logits
        launch_rows(_verify_rejection_logits_kernel, R, V, target_logits.device, draft_token_ids, cu_num_draft_tokens,
                    q, q.stride(0), target_logits, target_logits.stride(0), temperature, seeds, offsets, out, n_acc,
                    R, V, max_k, HAS_Q=draft_probs is not None)
    return out, n_acc
