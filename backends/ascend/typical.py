from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.typical import verify_typical as _reference


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU).
@torch.library.custom_op("spec_hal_ascend::verify_typical", mutates_args=())
def _verify_typical(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_probs: Tensor, seeds: Tensor,
        offsets: Tensor, max_k: int, posterior_threshold: float, posterior_alpha: float) -> tuple[Tensor, Tensor]:
    return _reference(
        draft_token_ids, cu_num_draft_tokens, target_probs, seeds, offsets, max_k, posterior_threshold,
        posterior_alpha)


_verify_typical.register_fake(FAKES["verify_typical"])   # the contract's fake kernel (hal.library)


def verify_typical(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_probs: Tensor, seeds: Tensor,
        offsets: Tensor, max_k: int, posterior_threshold: float, posterior_alpha: float) -> tuple[Tensor, Tensor]:
    return _verify_typical(
        draft_token_ids, cu_num_draft_tokens, target_probs, seeds, offsets, max_k, posterior_threshold,
        posterior_alpha)
