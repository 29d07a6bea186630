from __future__ import annotations

from torch import Tensor

from backends.ascend import _adapter


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    # torch_npu.npu_scatter_pa_kv_cache, ND layout ("Norm"), on contiguous caches: another
    # layout (a head-padded cache, say) is written through a contiguous copy, then copied back.
    if key.shape[0] == 0:
        return
    kc, vc = k_cache.contiguous(), v_cache.contiguous()
    _adapter.run(_adapter.scatter_pa_kv_cache(key.contiguous(), value.contiguous(), kc, vc, slot_mapping))
    for c, w in ((k_cache, kc), (v_cache, vc)):
        if w is not c:
            c.copy_(w)
