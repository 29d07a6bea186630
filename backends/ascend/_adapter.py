"""The one door to torch_npu. Pure functions map HAL arguments to torch_npu calls
(`Call`: op name, positional and keyword arguments), so the mapping itself is
testable against the real op schemas; `run` executes a call on torch_npu, or on the
CPU emulation (`backends.ascend._emulate`) under HAL_ASCEND_EMULATE=1.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from hal.errors import arg_error

MAX_VERIFY_Q = 16          # 1 + k on the TND verify path
CAUSAL_MASK_SIZE = 2048    # sparse_mode=3 takes a fixed 2048 x 2048 int8 causal mask


class Call(NamedTuple):
    op: str
    args: tuple
    kwargs: dict


def _ops():
    from backends.ascend import emulated
    return importlib.import_module("backends.ascend._emulate" if emulated() else "torch_npu")


def run(call: Call) -> Any:
    return getattr(_ops(), call.op)(*call.args, **call.kwargs)


def scatter_pa_kv_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> Call:
    """write_kv -> npu_scatter_pa_kv_cache in the ND ("Norm") layout (the op's default is PA_NZ)."""
    return Call("npu_scatter_pa_kv_cache", (), dict(key=key, value=value.to(v_cache.dtype), key_cache=k_cache,
                                                    value_cache=v_cache, slot_mapping=slot_mapping.to(torch.int32).contiguous(),
                                                    cache_mode="Norm"))


_causal: dict[torch.device, Tensor] = {}


def causal_mask(device) -> Tensor:
    if device not in _causal:
        _causal[device] = torch.triu(torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.int8, device=device), 1)
    return _causal[device]


def fused_infer_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                          query_start_loc: Tensor, scale: float) -> Call:
    """paged_attention -> npu_fused_infer_attention_score, TND layout, block table,
    cumulative query lengths, per-sequence KV lengths, sparse_mode=3 (causal, bottom-right)."""
    T, Hq, D = query.shape
    nb, bs, Hkv, _ = k_cache.shape
    if bs % 128 or bs > 512:
        raise arg_error("k_cache", "block_size a multiple of 128, at most 512 (Ascend)", bs)
    if D % 16:
        raise arg_error("query", "head_dim aligned to 16 (Ascend)", D)
    if block_tables.dtype != torch.int32:
        raise arg_error("block_tables", "int32 (Ascend)", block_tables.dtype)
    cu = query_start_loc.tolist()[1:]          # the op takes host lists (SymInt[])
    kv = seq_lens.tolist()
    if (cu[-1] if cu else 0) != T:
        raise arg_error("query_start_loc", f"a last cumulative length equal to T ({T})", cu[-1] if cu else 0)
    starts = [0] + cu[:-1]
    for r, (a, b, s) in enumerate(zip(starts, cu, kv)):
        q_len = b - a
        if q_len > MAX_VERIFY_Q and q_len != s:   # a verify step, not a prefill
            raise arg_error("query_start_loc", f"1 + k <= {MAX_VERIFY_Q} on the TND verify path (Ascend)",
                            f"{q_len} queries for request {r}")
    # reshape, not view: a head-padded (non-packed) cache is read through a packed copy
    return Call("npu_fused_infer_attention_score", (query.contiguous(), k_cache.reshape(nb, bs, Hkv * D),
                                                    v_cache.reshape(nb, bs, Hkv * D)),
                dict(atten_mask=causal_mask(query.device), actual_seq_lengths=cu, actual_seq_lengths_kv=kv,
                     block_table=block_tables.contiguous(), num_heads=Hq, num_key_value_heads=Hkv, scale=float(scale),
                     input_layout="TND", block_size=bs, sparse_mode=3))


def top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Call:
    """sample's filtering -> npu_top_k_top_p(logits, p, k); our disabled top-k (< 1) becomes k = V."""
    V = logits.shape[-1]
    k = torch.where((top_k >= 1) & (top_k < V), top_k, V).to(torch.int32)
    return Call("npu_top_k_top_p", (logits,), dict(p=top_p.to(logits.dtype), k=k))

