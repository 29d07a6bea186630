from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.rejection_logits import from_logits


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU; no host sync).
@torch.library.custom_op("spec_hal_ascend::verify_rejection_logits", mutates_args=())
def _verify_rejection_logits(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None, target_logits: Tensor,
        temperature: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return from_logits(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature, seeds, offsets,
                       max_k, None)    # all rows at once: few kernels on the NPU


_verify_rejection_logits.register_fake(FAKES["verify_rejection_logits"])   # the contract's fake kernel (hal.library)


def verify_rejection_logits(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None, target_logits: Tensor,
        temperature: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return _verify_rejection_logits(draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature,
                                    seeds, offsets, max_k)
