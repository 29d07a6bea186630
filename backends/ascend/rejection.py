from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.rejection import verify_rejection as _reference


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU).
@torch.library.custom_op("spec_hal_ascend::verify_rejection", mutates_args=())
def _verify_rejection(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
        target_probs: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return _reference(
        draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, seeds, offsets, max_k)


_verify_rejection.register_fake(FAKES["verify_rejection"])   # the contract's fake kernel (hal.library)


def verify_rejection(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
        target_probs: Tensor, seeds: Tensor, offsets: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return _verify_rejection(
        draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, seeds, offsets, max_k)
