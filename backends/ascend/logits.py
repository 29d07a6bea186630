"""`process_logits` on the NPU: the reference composed of torch ops (aclnn kernels on an NPU,
no host sync), registered as a torch.library custom op with the contract's fake kernel, as
`backends.ascend.rejection_logits`. Not executed on an NPU here; checked under the CPU
emulation like the other ops."""

from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.logits import process_logits as _reference


@torch.library.custom_op("spec_hal_ascend::process_logits", mutates_args=())
def _process_logits(logits: Tensor, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor | None,
                    penalties: Tensor | None, token_counts: Tensor | None, prompt_mask: Tensor | None,
                    bias: Tensor | None, bad_words: Tensor | None, bad_word_owner: Tensor | None,
                    history: Tensor | None, stop_ids: Tensor | None, min_tokens: Tensor | None,
                    min_p: Tensor | None, max_k: int) -> Tensor:
    return _reference(logits, draft_token_ids, cu_num_draft_tokens, parent_ids, penalties, token_counts, prompt_mask,
                      bias, bad_words, bad_word_owner, history, stop_ids, min_tokens, min_p, max_k)


_process_logits.register_fake(FAKES["process_logits"])


def process_logits(logits: Tensor, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor | None,
                   penalties: Tensor | None, token_counts: Tensor | None, prompt_mask: Tensor | None,
                   bias: Tensor | None, bad_words: Tensor | None, bad_word_owner: Tensor | None,
                   history: Tensor | None, stop_ids: Tensor | None, min_tokens: Tensor | None,
                   min_p: Tensor | None, max_k: int) -> Tensor:
    return _process_logits(logits, draft_token_ids, cu_num_draft_tokens, parent_ids, penalties, token_counts,
                           prompt_mask, bias, bad_words, bad_word_owner, history, stop_ids, min_tokens, min_p, max_k)
