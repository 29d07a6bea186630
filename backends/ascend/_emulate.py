"""CPU references of the torch_npu ops the adapter calls, written from their
documented semantics (used under HAL_ASCEND_EMULATE=1). Same names and signatures."""

from __future__ import annotations

import torch
from torch import Tensor

from verify_ops.paged_attention import paged_attention as _paged


def npu_scatter_pa_kv_cache(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                            *, compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode: str = "PA_NZ") -> None:
    # ND ("Norm"): cache [num_blocks, block_size, H, D]; token t -> slot_mapping[t]; negative slots skipped.
    assert cache_mode == "Norm", "the emulation implements the ND layout only"
    bs = key_cache.shape[1]
    keep = slot_mapping >= 0
    s = slot_mapping[keep].long()
    key_cache[s // bs, s % bs] = key[keep].to(key_cache.dtype)
    value_cache[s // bs, s % bs] = value[keep].to(value_cache.dtype)


def npu_fused_infer_attention_score(query: Tensor, key: Tensor, value: Tensor, *, atten_mask=None,
                                    actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None,
                                    num_heads: int = 1, scale: float = 1.0, input_layout: str = "BSH",
                                    num_key_value_heads: int = 0, sparse_mode: int = 0, block_size: int = 0,
                                    **unused) -> tuple[Tensor, Tensor]:
    # TND + paged KV ([blocks, block_size, Hkv*D]); sparse_mode 3: query i of a request with
    # q_len queries and kv_len keys sees keys j <= kv_len - q_len + i (bottom-right causal).
    assert input_layout == "TND" and sparse_mode == 3 and block_table is not None
    assert atten_mask is not None and atten_mask.shape == (2048, 2048)
    T, Hq, D = query.shape
    Hkv = num_key_value_heads or num_heads
    nb, bs, _ = key.shape
    qsl = torch.tensor([0] + list(actual_seq_lengths))
    out = _paged(query, key.view(nb, bs, Hkv, D), value.view(nb, bs, Hkv, D), block_table,
                 torch.tensor(list(actual_seq_lengths_kv)), qsl, scale, None)
    return out, torch.empty(0)


def npu_top_k_top_p(logits: Tensor, p: Tensor | None = None, k: Tensor | None = None) -> Tensor:
    # Keep logits >= the k-th largest, then the smallest most-likely set reaching mass p
    # (ties at each cutoff kept); the rest become -inf.
    V = logits.shape[-1]
    kk = torch.full((logits.shape[0],), V, dtype=torch.long) if k is None else k.long().clamp(1, V)
    vals = logits.float().sort(dim=-1, descending=True).values
    cut = vals.gather(1, (kk - 1)[:, None])
    vals = vals.masked_fill(vals < cut, -torch.inf)
    if p is not None:
        pv = vals.softmax(-1)
        keep = (pv.cumsum(-1) - pv < p.float()[:, None]) | (torch.arange(V) == 0)
        cut = torch.maximum(cut, vals.masked_fill(~keep, torch.inf).amin(-1, keepdim=True))
    return logits.masked_fill(logits.float() < cut, -torch.inf)
