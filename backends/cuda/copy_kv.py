from __future__ import annotations

import torch
from torch import Tensor

from backends.cuda._common import copy_rows, dense, in_place


def copy_kv(k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
    # Gather every source row into a staging buffer, then scatter: overlapping moves are safe.
    M = src_slots.shape[0]
    if M == 0:
        return
    rows, src_slots, dst_slots = torch.arange(M, device=src_slots.device), *dense(src_slots, dst_slots)

    def move(*caches):
        for cache in caches:
            staged = torch.empty(M, cache.shape[2] * cache.shape[3], dtype=cache.dtype, device=cache.device)
            copy_rows(cache, src_slots, staged, rows)
            copy_rows(staged, rows, cache, dst_slots)
    in_place(move, k_cache, v_cache)
