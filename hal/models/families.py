"""What the families add to a Llama layer, as `hal.models.llama.LlamaConfig` fields say (transformers'
modeling code): q, k, v biases (Qwen2; Llama's and Qwen3's ``attention_bias``) and per-head RMSNorm
of q and k (Qwen3), and a sliding window (Mistral) refused past its length. Row by row, so batch-invariant; the q/k
norms run on the model's row kernels (`hal.models.row_kernels`), the native layer loop's too, for the same bits."""

from __future__ import annotations

import torch
from torch import Tensor

from hal.errors import HalError


def head_norm(x: Tensor, heads: int, w: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """``x`` [T, heads * D] RMS-normed per head as ``Qwen3RMSNorm``: in float32, the weight applied
    after casting back; returned in ``dtype``."""
    T = x.shape[0]
    x32 = x.reshape(T, heads, -1).float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (w * x32.to(x.dtype)).reshape(T, -1).to(dtype)


def qkv_extras(cfg, w: dict[str, Tensor], i: int, qkv: Tensor, rows) -> Tensor:
    """Layer ``i``'s fused projections [T, (Hq + 2 Hkv) D] with the family's additions: the
    biases (``{i}.bqkv``), then the q and k norms (``{i}.q_norm``, ``{i}.k_norm``) by ``rows``
    (`hal.models.row_kernels`: the fused kernel the native loop runs too, or ATen steps)."""
    nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if cfg.qkv_bias:
        qkv = (qkv + w[f"{i}.bqkv"]).to(qkv.dtype)
    if cfg.qk_norm:
        qkv = qkv.contiguous()
        qkv = torch.cat([rows.head_norm(qkv[:, :nq], cfg.heads, w[f"{i}.q_norm"], cfg.eps),
                         rows.head_norm(qkv[:, nq:nq + nk], cfg.kv_heads, w[f"{i}.k_norm"], cfg.eps),
                         qkv[:, nq + nk:]], -1)
    return qkv.contiguous()


def within_window(cfg, batch) -> None:
    """`HalError` naming ``positions`` when a forward reaches the sliding window (full attention
    equals the window only within it; sliding attention is not implemented), before any KV write."""
    last = batch.max_position if batch.max_position is not None else int(batch.positions.max())
    if last >= cfg.sliding_window:
        raise HalError(f"positions: expected positions below the model's sliding window ({cfg.sliding_window}; "
                       f"sliding attention is not implemented), got {last}", arg="positions")
