from __future__ import annotations

import torch
from torch import Tensor

from backends.cuda._common import copy_rows, dense, in_place


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    # Row t of key/value -> cache slot slot_mapping[t]; -1 skips (the kernel never stores it).
    T = key.shape[0]
    if T == 0:
        return
    rows, slot_mapping = torch.arange(T, device=key.device), dense(slot_mapping)
    # cast on the host side (torch's round-to-nearest-even, as the reference): the kernel only moves rows
    key, value = key.reshape(T, -1).to(k_cache.dtype).contiguous(), value.reshape(T, -1).to(v_cache.dtype).contiguous()

    def write(kc, vc):
        copy_rows(key, rows, kc, slot_mapping)
        copy_rows(value, rows, vc, slot_mapping)
    in_place(write, k_cache, v_cache)
