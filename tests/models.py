"""Random-weight Llama runners for tests (the runner's own fused weight names)."""

from __future__ import annotations

import torch

import hal
from hal.models.llama import Llama, LlamaConfig


def random_llama(H: int, layers: int, heads: int, kv_heads: int, D: int, ffn: int, V: int, seed: int,
                 scale: float, embed_scale: float = 1.0, backend: str = "cpu") -> Llama:
    """A GGUF-style (interleaved RoPE) Llama with N(0, scale) weights and norms near 1."""
    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(hidden=H, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=D, ffn=ffn, vocab=V,
                      rope_base=10000.0, eps=1e-5, rope_interleaved=True)
    w = {"embed": torch.randn(V, H, generator=g) * embed_scale, "norm": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(layers):
        w[f"{i}.attn_norm"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[f"{i}.ffn_norm"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[f"{i}.wqkv"] = torch.randn((heads + 2 * kv_heads) * D, H, generator=g) * scale
        w[f"{i}.wo"] = torch.randn(H, heads * D, generator=g) * scale
        w[f"{i}.wgu"] = torch.randn(2 * ffn, H, generator=g) * scale
        w[f"{i}.wdown"] = torch.randn(H, ffn, generator=g) * scale
    return Llama(cfg, w, hal.get_backend(backend))
