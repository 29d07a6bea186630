"""Argument checks of `hal.ops.Ops.process_logits` (run by `hal.Backend`, as `hal.checks`
for the other ops): each processor group given whole or not at all, shapes, dtypes and
devices always; values (ranges, NaN) when the backend checks values."""

from __future__ import annotations

import math

import torch

from hal.checks import F32, FLOATS, INTS, _ragged, _ragged_values, index_values, logits_values, same_device, \
    tensor, tree_parents
from hal.errors import arg_error


def process_logits(be, logits, draft_token_ids, cu_num_draft_tokens, parent_ids, penalties, token_counts,
                   prompt_mask, bias, bad_words, bad_word_owner, history, stop_ids, min_tokens, min_p,
                   max_k) -> None:
    N, R = _ragged(be, draft_token_ids, cu_num_draft_tokens, max_k)
    tensor(be, "logits", logits, FLOATS, (N + R, None))
    V = logits.shape[1]
    if V < 1:
        raise arg_error("logits", "a vocabulary of at least 1", f"shape {list(logits.shape)}")
    if parent_ids is not None:
        tensor(be, "parent_ids", parent_ids, INTS, (N,))
    groups = {"penalties": (penalties, ("token_counts", token_counts), ("prompt_mask", prompt_mask)),
              "bad_words": (bad_words, ("bad_word_owner", bad_word_owner), ("history", history)),
              "stop_ids": (stop_ids, ("min_tokens", min_tokens))}
    for lead, (t, *rest) in groups.items():
        for name, other in rest:   # a group is given whole or not at all
            if (t is None) != (other is None):
                raise arg_error(name, f"{'None' if t is None else 'a tensor'} ({lead} is "
                                f"{'None' if t is None else 'given'})", "a tensor" if other is not None else None)
    if penalties is not None:
        tensor(be, "penalties", penalties, F32, (R, 3))
        tensor(be, "token_counts", token_counts, INTS, (R, V))
        tensor(be, "prompt_mask", prompt_mask, (torch.bool,), (R, V))
    if bias is not None:
        tensor(be, "bias", bias, F32, (R, V))
    if bad_words is not None:
        tensor(be, "bad_words", bad_words, INTS, ndim=2)
        tensor(be, "bad_word_owner", bad_word_owner, INTS, (bad_words.shape[0],))
        tensor(be, "history", history, INTS, (R, None))
        if bad_words.shape[1] < 1:
            raise arg_error("bad_words", "words of at least one token", f"shape {list(bad_words.shape)}")
    if stop_ids is not None:
        tensor(be, "stop_ids", stop_ids, INTS, (R, None))
        tensor(be, "min_tokens", min_tokens, INTS, (R,))
    if min_p is not None:
        tensor(be, "min_p", min_p, F32, (R, 2))
    same_device(dict(logits=logits, draft_token_ids=draft_token_ids, cu_num_draft_tokens=cu_num_draft_tokens,
                     parent_ids=parent_ids, penalties=penalties, token_counts=token_counts, prompt_mask=prompt_mask,
                     bias=bias, bad_words=bad_words, bad_word_owner=bad_word_owner, history=history,
                     stop_ids=stop_ids, min_tokens=min_tokens, min_p=min_p))
    _ragged_values(be, draft_token_ids, cu_num_draft_tokens, max_k, V)
    if be.check_values:
        logits_values("logits", logits)
        if parent_ids is not None:
            tree_parents("parent_ids", parent_ids, cu_num_draft_tokens)
        if penalties is not None:
            if not bool(torch.isfinite(penalties).all()) or bool((penalties[:, 2] <= 0).any()):
                raise arg_error("penalties", "finite (frequency, presence, repetition > 0) rows", "a bad row")
            if token_counts.numel() and int(token_counts.amin()) < 0:
                raise arg_error("token_counts", "counts >= 0", int(token_counts.amin()))
        if bias is not None and bias.numel() and (bool(torch.isnan(bias).any()) or bool((bias == math.inf).any())):
            raise arg_error("bias", "no NaN or +inf (-inf marks a token not allowed)", "NaN/+inf")
        if bad_words is not None:
            index_values("bad_words", bad_words, -1, V, " (token ids; -1 pads on the left)")
            index_values("bad_word_owner", bad_word_owner, 0, max(R, 1), " (request indices)")
            index_values("history", history, -1, V, " (token ids; -1 pads)")
        if stop_ids is not None:
            index_values("stop_ids", stop_ids, -1, V, " (token ids; -1 pads)")
            if min_tokens.numel() and int(min_tokens.amin()) < 0:
                raise arg_error("min_tokens", "values >= 0", int(min_tokens.amin()))
        if min_p is not None and min_p.numel() and not bool(((min_p[:, 0] >= 0) & (min_p[:, 0] <= 1)
                                                              & (min_p[:, 1] >= 0)
                                                              & torch.isfinite(min_p[:, 1])).all()):
            raise arg_error("min_p", "rows (min_p in [0, 1], a finite temperature >= 0)", "a bad row")
