from __future__ import annotations

from torch import Tensor


def copy_kv(k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
    # Gather every source first (advanced indexing copies), then scatter.
    bs = k_cache.shape[1]
    src, dst = src_slots.long(), dst_slots.long()
    k, v = k_cache[src // bs, src % bs], v_cache[src // bs, src % bs]
    k_cache[dst // bs, dst % bs] = k
    v_cache[dst // bs, dst % bs] = v
