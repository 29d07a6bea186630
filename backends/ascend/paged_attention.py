from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend import _adapter
from hal.library import FAKES
from verify_ops.paged_attention import paged_attention as _reference


@torch.library.custom_op("spec_hal_ascend::tree_attention", mutates_args=())
def _tree_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, scale: float, tree_mask: Tensor) -> Tensor:
    return _reference(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, tree_mask)


_tree_attention.register_fake(FAKES["paged_attention"])   # the contract's fake kernel (hal.library)


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, scale: float, tree_mask: Tensor | None) -> Tensor:
    # Causal: torch_npu.npu_fused_infer_attention_score (TND, sparse_mode=3). Its sparse modes
    # have no tree mask, so tree attention is a custom op composed of torch ops (aclnn).
    if tree_mask is not None:
        return _tree_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, tree_mask)
    out, _ = _adapter.run(_adapter.fused_infer_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                                         query_start_loc, scale))
    return out
