"""Forwards the model tests share."""

from __future__ import annotations

import torch

from hal.engine.forward import forward
from hal.kv import KVPool


def prefill_then_verify(model, ids: list[int], split: int) -> torch.Tensor:
    """Every row's logits, float32: ``ids[:split]`` as a prefill, then the rest as one verify
    (a fresh pool in the model's dtype)."""
    cfg = model.cfg
    pool = KVPool(model.be, 16, 16, cfg.kv_heads, cfg.head_dim, num_layers=cfg.layers, dtype=model.dtype)
    seq = pool.sequence()
    prefill, _ = forward(model, pool, [seq], [ids[:split]], True)
    seq.commit(split)
    verify, _ = forward(model, pool, [seq], [ids[split:]], True)
    return torch.cat([prefill, verify]).float()
