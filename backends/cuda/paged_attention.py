from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import dense, num_programs, unit_stride


@triton.jit
def _paged_attention_kernel(q_ptr, sq0, sq1, k_ptr, v_ptr, sk0, sk1, sk2, bt_ptr, stride_bt, seq_ptr, qsl_ptr,
                            req_ptr, mask_ptr, stride_m, out_ptr, so0, so1, T, Hkv, G, D, bs, scale, NPROG,
                            HAS_TREE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    # One (query token, kv head) per work item, its G query heads together. Keys j < ctx are
    # context; own queries j - ctx <= i (causal) or tree_mask[t, j - ctx]. Online softmax in fp32.
    pid = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm, dm = g < G, d < D
    for item in range(pid, T * Hkv, NPROG):
        t = item // Hkv
        h = item % Hkv
        r = tl.load(req_ptr + t)
        qs = tl.load(qsl_ptr + r)
        q_len = tl.load(qsl_ptr + r + 1) - qs
        seq = tl.load(seq_ptr + r)
        ctx = seq - q_len
        i = t - qs
        limit = seq if HAS_TREE else ctx + i + 1
        q = tl.load(q_ptr + t * sq0 + (h * G + g)[:, None] * sq1 + d[None, :], mask=gm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        lsum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(0, limit, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < limit
            if HAS_TREE:
                own = tl.load(mask_ptr + t * stride_m + (n - ctx), mask=nm & (n >= ctx), other=0)
                nm = nm & ((n < ctx) | (own != 0))
            blk = tl.load(bt_ptr + r * stride_bt + n // bs, mask=n < limit, other=0).to(tl.int64)
            off = blk * sk0 + (n % bs) * sk1 + h * sk2
            kv_mask = nm[:, None] & dm[None, :]
            kt = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            vt = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale
            s = tl.where(nm[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m = m_new
        out = acc / lsum[:, None]
        tl.store(out_ptr + t * so0 + (h * G + g)[:, None] * so1 + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, scale: float, tree_mask: Tensor | None) -> Tensor:
    T, Hq, D = query.shape
    _, bs, Hkv, _ = k_cache.shape
    # the kernel reads any strides but a unit one along head_dim (head-padded caches included)
    query, k_cache, v_cache = unit_stride(query), unit_stride(k_cache), unit_stride(v_cache)
    block_tables, seq_lens, query_start_loc, tree_mask = dense(block_tables, seq_lens, query_start_loc, tree_mask)
    out = torch.empty_like(query)
    R = block_tables.shape[0]
    if T == 0 or R == 0:
        return out
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    req = torch.repeat_interleave(torch.arange(R, device=query.device), q_len, output_size=T)
    mask = tree_mask.to(torch.int8).contiguous() if tree_mask is not None else req
    n = num_programs(T * Hkv, query.device)
    _paged_attention_kernel[(n,)](query, query.stride(0), query.stride(1), k_cache, v_cache, k_cache.stride(0),
                                  k_cache.stride(1), k_cache.stride(2), block_tables, block_tables.stride(0),
                                  seq_lens, query_start_loc, req, mask, mask.stride(0), out, out.stride(0),
                                  out.stride(1), T, Hkv, Hq // Hkv, D, bs, float(scale), n,
                                  HAS_TREE=tree_mask is not None, BLOCK_G=max(16, triton.next_power_of_2(Hq // Hkv)),
                                  BLOCK_N=max(16, min(64, triton.next_power_of_2(bs))),
                                  BLOCK_D=max(16, triton.next_power_of_2(D)))
    return out
