from __future__ import annotations

import torch
from torch import Tensor

from verify_ops.rejection_logits import from_logits


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU; no host sync).
@torch.library.custom_op("spec_hal_ascend::verify_rejection_logits", mutates_args=())
def _verify_rejection_logits(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None, target_logits: Tensor,
        temperature: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return from_logits(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature, seeds, offsets,
                       max_k, None)    # all rows at once: few kernels on the NPU


@_verify_rejection_logits.register_fake
def _(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature, seeds, offsets, max_k):
    R = cu_num_draft_tokens.shape[0] - 1
    return (target_logits.new_empty((R, max_k + 1), dtype=torch.int32),
            target_logits.new_empty((R,), dtype=torch.int32))


def verify_rejection_logits(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None, target_logits: Tensor,
        temperature: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return _verify_rejection_logits(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature,
                                    seeds, offsets, max_k)
