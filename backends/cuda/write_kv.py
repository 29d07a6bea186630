from __future__ import annotations

import torch
from torch import Tensor

from backends.cuda._common import copy_rows, require_packed_heads


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    # Row t of key/value -> cache slot slot_mapping[t]; -1 skips (the kernel never stores it).
    require_packed_heads("k_cache", k_cache)
    require_packed_heads("v_cache", v_cache)
    T = key.shape[0]
    rows = torch.arange(T, device=key.device)
    copy_rows(key.reshape(T, -1).contiguous(), rows, k_cache, slot_mapping)
    copy_rows(value.reshape(T, -1).contiguous(), rows, v_cache, slot_mapping)
