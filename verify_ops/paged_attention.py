from __future__ import annotations

import torch
from torch import Tensor


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                    seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                    tree_mask: Tensor | None) -> Tensor:
    # Pad queries to [R, Q]; gather each request's blocks to [R, L] keys. Query i of a
    # request sees keys j < ctx (= seq_len - q_len) and, among its own queries,
    # j - ctx <= i (causal) or tree_mask[i, j - ctx]. fp32 softmax; GQA: head h reads kv head h // G.
    T, Hq, D = query.shape
    _, bs, Hkv, _ = k_cache.shape
    R = block_tables.shape[0]
    qsl, seq = query_start_loc.long(), seq_lens.long()
    q_len = qsl[1:] - qsl[:-1]
    # the padded query width: the tree mask's (host-known, >= every q_len); else the longest query,
    # read on the host: only the cpu backend runs this causal path, on host tensors
    Q = tree_mask.shape[1] if tree_mask is not None else int(q_len.max()) if R else 0
    L = block_tables.shape[1] * bs
    dev = query.device
    used = torch.arange(block_tables.shape[1], device=dev)[None] * bs < seq[:, None]
    bt = torch.where(used, block_tables.long(), 0)      # entries past seq_len are never read (nor checked)
    keys = k_cache[bt].reshape(R, L, Hkv, D).float().transpose(1, 2)   # [R, Hkv, L, D]
    vals = v_cache[bt].reshape(R, L, Hkv, D).float().transpose(1, 2)
    j = torch.arange(L, device=dev)
    if Q == 1 and T == R and tree_mask is None:     # decode: one query per request, keys j < seq_len
        out = torch.nn.functional.scaled_dot_product_attention(
            query.float().reshape(R, 1, Hq, D).transpose(1, 2), keys, vals,
            attn_mask=(j[None] < seq[:, None])[:, None, None], scale=scale, enable_gqa=True)
        return out.view(R, Hq, D).to(query.dtype)
    qi = torch.arange(Q, device=dev)[None]
    q_valid = qi < q_len[:, None]                                        # [R, Q]
    q = query[(qsl[:-1, None] + qi).clamp(max=max(T - 1, 0))].float() if T else query.new_zeros(R, Q, Hq, D).float()

    ctx = (seq - q_len)[:, None, None]
    j = j[None, None]                                                    # [1, 1, L]
    i = qi[:, :, None]                                                   # [1, Q, 1]
    if tree_mask is None:
        own = j - ctx <= i
    else:
        tm = tree_mask[(qsl[:-1, None] + qi).clamp(max=max(T - 1, 0))] if T else \
            torch.zeros(R, Q, 1, dtype=torch.bool, device=dev)         # [R, Q, W]
        jj = (j - ctx).clamp(0, tm.shape[-1] - 1).expand(R, Q, L)
        own = tm.gather(2, jj)
    visible = (j < seq[:, None, None]) & ((j < ctx) | own)               # [R, Q, L]
    visible = visible | ~q_valid[:, :, None]                             # padding rows: avoid NaN

    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys, vals, attn_mask=visible[:, None], scale=scale, enable_gqa=True)  # [R, Hq, Q, D]
    return out.transpose(1, 2)[q_valid].to(query.dtype)
