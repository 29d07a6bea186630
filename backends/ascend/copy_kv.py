from __future__ import annotations

import torch
from torch import Tensor

from hal.library import FAKES
from verify_ops.copy_kv import copy_kv as _reference


# A torch.library custom op: schema from the signature, a fake (meta) kernel, and the
# reference composed of torch ops as the implementation (aclnn kernels on an NPU).
@torch.library.custom_op("spec_hal_ascend::copy_kv", mutates_args=("k_cache", "v_cache"))
def _copy_kv(
        k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
    _reference(
        k_cache, v_cache, src_slots, dst_slots)


_copy_kv.register_fake(FAKES["copy_kv"])   # the contract's fake kernel (hal.library)


def copy_kv(
        k_cache: Tensor, v_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
    _copy_kv(
        k_cache, v_cache, src_slots, dst_slots)
