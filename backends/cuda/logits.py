"""`process_logits` on the GPU: the reference composed of torch ops (elementwise passes,
gathers and one scatter-add per processor on device tensors, no host sync), not a Triton
kernel. Validated as the other ops of this backend are: on CPU tensors under the conformance
suite; on a device only where a run says so."""

from __future__ import annotations

from torch import Tensor

from verify_ops.logits import process_logits as _reference


def process_logits(logits: Tensor, draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, parent_ids: Tensor | None,
                   penalties: Tensor | None, token_counts: Tensor | None, prompt_mask: Tensor | None,
                   bias: Tensor | None, bad_words: Tensor | None, bad_word_owner: Tensor | None,
                   history: Tensor | None, stop_ids: Tensor | None, min_tokens: Tensor | None,
                   min_p: Tensor | None, max_k: int) -> Tensor:
    return _reference(logits, draft_token_ids, cu_num_draft_tokens, parent_ids, penalties, token_counts, prompt_mask,
                      bias, bad_words, bad_word_owner, history, stop_ids, min_tokens, min_p, max_k)
