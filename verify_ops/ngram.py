from __future__ import annotations

import torch
from torch import Tensor


def ngram_propose(token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int,
                  k: int) -> tuple[Tensor, Tensor]:
    # match[r, e] = length (<= max_n) of the common suffix of history[:e+1] and history,
    # for ends e <= len-2. Take the longest n >= min_n, its earliest end e, and
    # propose history[e+1 : e+1+k] (cut at the end of the history).
    R, L = token_ids.shape
    dev = token_ids.device
    if L == 0:  # no history: nothing to match
        return (torch.full((R, k), -1, dtype=torch.int32, device=dev), torch.zeros(R, dtype=torch.int32, device=dev))
    n_tok = num_tokens.long()
    ends = torch.arange(L, device=dev)[None]                      # [1, L]
    run = torch.ones(R, L, dtype=torch.bool, device=dev) & (ends <= n_tok[:, None] - 2)
    match = torch.zeros(R, L, dtype=torch.long, device=dev)
    for j in range(min(max_n, L)):                                  # compare the j-th token back
        a = token_ids.gather(1, (ends - j).clamp(min=0).expand(R, L))
        b = token_ids.gather(1, (n_tok - 1 - j).clamp(min=0)[:, None])
        run = run & (ends - j >= 0) & (n_tok[:, None] - 1 - j >= 0) & (a == b)
        match += run.long()
    best = match.max(-1).values
    end = (match == best[:, None]).int().argmax(-1)
    found = best >= min_n
    start = end + 1
    num = torch.where(found, torch.clamp(n_tok - start, max=k), 0)
    pos = torch.arange(k, device=dev)[None]
    drafts = token_ids.gather(1, (start[:, None] + pos).clamp(max=L - 1))
    return torch.where(pos < num[:, None], drafts, -1).int(), num.int()
