from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.greedy import verify_greedy as _reference


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU).
@torch.library.custom_op("spec_hal_ascend::verify_greedy", mutates_args=())
def _verify_greedy(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_logits: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return _reference(
        draft_token_ids, cu_num_draft_tokens, target_logits, max_k)


_verify_greedy.register_fake(FAKES["verify_greedy"])   # the contract's fake kernel (hal.library)


def verify_greedy(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_logits: Tensor, max_k: int) -> tuple[Tensor, Tensor]:
    return _verify_greedy(
        draft_token_ids, cu_num_draft_tokens, target_logits, max_k)
