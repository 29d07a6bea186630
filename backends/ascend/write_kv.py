from __future__ import annotations

from torch import Tensor

from backends.ascend import _adapter


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    # torch_npu.npu_scatter_pa_kv_cache, ND layout ("Norm").
    _adapter.run(_adapter.scatter_pa_kv_cache(key, value, k_cache, v_cache, slot_mapping))
