from __future__ import annotations

from torch import Tensor


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    # slot = block * block_size + offset; slot -1 is padding and writes nothing.
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # host tensors: this check is free
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    slots = slot_mapping.long()
    k_cache[slots // bs, slots % bs] = key.to(k_cache.dtype)
    v_cache[slots // bs, slots % bs] = value.to(v_cache.dtype)
