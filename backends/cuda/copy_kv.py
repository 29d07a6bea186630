from __future__ import annotations

import torch
from torch import Tensor

from backends.cuda._common import copy_rows, require_packed_heads


def copy_kv(k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
    # Gather every source row into a staging buffer, then scatter: overlapping moves are safe.
    require_packed_heads("k_cache", k_cache)
    require_packed_heads("v_cache", v_cache)
    M = src_slots.shape[0]
    rows = torch.arange(M, device=src_slots.device)
    for cache in (k_cache, v_cache):
        staged = torch.empty(M, cache.shape[2] * cache.shape[3], dtype=cache.dtype, device=cache.device)
        copy_rows(cache, src_slots, staged, rows)
        copy_rows(staged, rows, cache, dst_slots)
