from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.tree import verify_tree as _reference


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU).
@torch.library.custom_op("spec_hal_ascend::verify_tree", mutates_args=())
def _verify_tree(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor, target: Tensor,
        draft_probs: Tensor | None, seeds: Tensor | None, offsets: Tensor | None, max_k: int) -> tuple[Tensor, Tensor, Tensor]:
    return _reference(
        draft_token_ids, cu_num_draft_tokens, parent_ids, target, draft_probs, seeds, offsets, max_k)


_verify_tree.register_fake(FAKES["verify_tree"])   # the contract's fake kernel (hal.library)


def verify_tree(
        draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor, target: Tensor,
        draft_probs: Tensor | None, seeds: Tensor | None, offsets: Tensor | None, max_k: int) -> tuple[Tensor, Tensor, Tensor]:
    return _verify_tree(
        draft_token_ids, cu_num_draft_tokens, parent_ids, target, draft_probs, seeds, offsets, max_k)
