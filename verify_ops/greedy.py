from __future__ import annotations

from torch import Tensor

from hal.reductions import first_max
from verify_ops._common import emit, ragged_layout, take


def verify_greedy(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, target_logits: Tensor,
                  max_k: int) -> tuple[Tensor, Tensor]:
    # Accept while draft_j == argmax(target_j); emit argmax_0..argmax_{n_acc}.
    # torch.argmax returns the first maximal index: ties go to the lowest token id.
    _, valid, draft_idx, rows = ragged_layout(cu_num_draft_tokens, max_k)
    top = first_max(target_logits.float())[1][rows]
    match = (take(draft_token_ids.long(), draft_idx) == top[:, :max_k]) & valid
    n_acc = match.int().cumprod(-1).sum(-1)
    return emit(top[:, :max_k], n_acc, top.gather(1, n_acc[:, None].long())[:, 0], max_k), n_acc.int()
