from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.ngram import ngram_propose as _reference


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU).
@torch.library.custom_op("spec_hal_ascend::ngram_propose", mutates_args=())
def _ngram_propose(
        token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int, k: int) -> tuple[Tensor, Tensor]:
    return _reference(
        token_ids, num_tokens, min_n, max_n, k)


_ngram_propose.register_fake(FAKES["ngram_propose"])   # the contract's fake kernel (hal.library)


def ngram_propose(
        token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int, k: int) -> tuple[Tensor, Tensor]:
    return _ngram_propose(
        token_ids, num_tokens, min_n, max_n, k)
