from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from backends.cuda._common import dense, launch_rows, load_requests, row_argmax, unit_stride, verify_outputs


@triton.jit
def _verify_greedy_kernel(draft_ptr, cu_ptr, logits_ptr, stride_l, out_ptr, nacc_ptr, R, V, max_k, NPROG,
                          BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # Row j of request r: argmax of target row cu[r] + r + j (fp32, lowest id on ties);
    # keep going while draft j equals it.
    pid = tl.program_id(0)
    for r0 in range(pid * BLOCK_R, R, NPROG * BLOCK_R):
        r, rm, start, k = load_requests(cu_ptr, r0, R, BLOCK_R)
        alive = rm
        n = tl.zeros([BLOCK_R], tl.int32)
        for j in range(0, max_k + 1):
            active = alive & (j <= k)
            row = start + r + j
            _, arg = row_argmax(logits_ptr, stride_l, row, active, V, BLOCK_R, BLOCK_V)
            tl.store(out_ptr + r * (max_k + 1) + j, arg, mask=active)
            d = tl.load(draft_ptr + start + j, mask=active & (j < k), other=-1)
            alive = active & (j < k) & (d == arg)
            n += alive.to(tl.int32)
        tl.store(nacc_ptr + r, n, mask=rm)


def verify_greedy(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_logits: Tensor,
                  max_k: int) -> tuple[Tensor, Tensor]:
    R, V = cu_num_draft_tokens.shape[0] - 1, target_logits.shape[1]
    target_logits = unit_stride(target_logits)
    draft_token_ids, cu_num_draft_tokens = dense(draft_token_ids, cu_num_draft_tokens)
    out, n_acc = verify_outputs(R, max_k, target_logits.device)
    if R:
        launch_rows(_verify_greedy_kernel, R, V, target_logits.device, draft_token_ids, cu_num_draft_tokens,
                    target_logits, target_logits.stride(0), out, n_acc, R, V, max_k)
    return out, n_acc
