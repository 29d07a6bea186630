from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import dense, num_programs, unit_stride


@triton.jit
def _ngram_propose_kernel(tok_ptr, stride_t, ntok_ptr, draft_ptr, num_ptr, R, L, min_n, max_n, k, NPROG,
                          BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    # match[e] = common-suffix length (<= max_n) of history[:e+1] and history, for e <= len-2.
    # The longest (>= min_n) wins, earliest end first; propose history[e+1 : e+1+k].
    pid = tl.program_id(0)
    for r0 in range(pid * BLOCK_R, R, NPROG * BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rm = r < R
        base = r.to(tl.int64) * stride_t
        n_tok = tl.load(ntok_ptr + r, mask=rm, other=0).to(tl.int64)
        best = tl.zeros([BLOCK_R], tl.int32)
        end = tl.zeros([BLOCK_R], tl.int64)
        for e0 in range(0, L, BLOCK_L):
            e = e0 + tl.arange(0, BLOCK_L).to(tl.int64)
            run = rm[:, None] & (e[None, :] <= n_tok[:, None] - 2)
            m = tl.zeros([BLOCK_R, BLOCK_L], tl.int32)
            for j in range(0, max_n):
                run = run & (e[None, :] - j >= 0) & (n_tok[:, None] - 1 - j >= 0)
                a = tl.load(tok_ptr + base[:, None] + e[None, :] - j, mask=run, other=-1)
                b = tl.load(tok_ptr + base + n_tok - 1 - j, mask=rm & (n_tok - 1 - j >= 0), other=-2)
                run = run & (a == b[:, None])
                m += run.to(tl.int32)
            tile_best = tl.max(m, 1)
            tile_end = tl.min(tl.where(m == tile_best[:, None], e[None, :], 2147483647), 1)
            better = tile_best > best
            best = tl.where(better, tile_best, best)
            end = tl.where(better, tile_end, end)
        start = end + 1
        num = tl.where(best >= min_n, tl.minimum(n_tok - start, k), 0)
        for j in range(0, k):
            d = tl.load(tok_ptr + base + start + j, mask=rm & (j < num), other=-1)
            tl.store(draft_ptr + r.to(tl.int64) * k + j, d.to(tl.int32), mask=rm)
        tl.store(num_ptr + r, num.to(tl.int32), mask=rm)


def ngram_propose(token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int, k: int) -> tuple[Tensor, Tensor]:
    R, L = token_ids.shape
    token_ids, num_tokens = unit_stride(token_ids), dense(num_tokens)
    max_n = min(max_n, L)  # no suffix is longer than the history
    drafts = torch.full((R, k), -1, dtype=torch.int32, device=token_ids.device)
    num = torch.zeros(R, dtype=torch.int32, device=token_ids.device)
    if R and L:
        block_l = min(triton.next_power_of_2(L), 1024)
        block_r = max(1, min(triton.next_power_of_2(R), 4096 // block_l))
        n = num_programs(triton.cdiv(R, block_r), token_ids.device)
        _ngram_propose_kernel[(n,)](token_ids, token_ids.stride(0), num_tokens, drafts, num, R, L, min_n, max_n, k,
                                    n, BLOCK_R=block_r, BLOCK_L=block_l)
    return drafts, num
