"""EAGLE-1's layer as a torch module (no input norm; ``fc`` over ``[embedding, feature]``), the
maths SafeAILab's EAGLE-1 runs: the tests' reference for the EAGLE-1 layout, and its writer of
random heads under the published names."""

from __future__ import annotations

import torch
from torch import Tensor


class Eagle1Module(torch.nn.Module):
    """EAGLE-1's layer over full causal sequences; `weights`
    returns its tensors under the published names."""

    def __init__(self, H: int, heads: int, kv_heads: int, ffn: int, rope_base: float, eps: float):
        super().__init__()
        nn = torch.nn
        self.H, self.heads, self.kv_heads, self.D, self.eps = H, heads, kv_heads, H // heads, eps
        self.fc = nn.Linear(2 * H, H)
        self.q, self.k, self.v = (nn.Linear(H, n * self.D, bias=False) for n in (heads, kv_heads, kv_heads))
        self.o = nn.Linear(heads * self.D, H, bias=False)
        self.gate, self.up = nn.Linear(H, ffn, bias=False), nn.Linear(H, ffn, bias=False)
        self.down = nn.Linear(ffn, H, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(H))
        for m in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down):
            nn.init.normal_(m.weight, std=0.02)
        from hal.models.rope import Rope
        self.rope = Rope(self.D, rope_base, False)

    def forward(self, emb, feat):
        """emb, feat [B, T, H] (pairs (f_t, x_{t+1}) at positions t) -> next features [B, T, H]."""
        import torch.nn.functional as F
        B, T, H = emb.shape
        h = self.fc(torch.cat([emb, feat], -1))
        rot = self.rope(torch.arange(T))
        q = self.rope.apply(self.q(h).view(B * T, self.heads, self.D), rot.repeat(B, 1))
        k = self.rope.apply(self.k(h).view(B * T, self.kv_heads, self.D), rot.repeat(B, 1))
        q = q.view(B, T, self.heads, self.D).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.D).transpose(1, 2)
        v = self.v(h).view(B, T, self.kv_heads, self.D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + self.o(o.transpose(1, 2).reshape(B, T, -1))
        x = F.rms_norm(h, (H,), self.ffn_norm, self.eps)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))

    def weights(self) -> dict[str, Tensor]:
        p = "layers.0."
        return {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias, p + "self_attn.q_proj.weight": self.q.weight,
                p + "self_attn.k_proj.weight": self.k.weight, p + "self_attn.v_proj.weight": self.v.weight,
                p + "self_attn.o_proj.weight": self.o.weight, p + "mlp.gate_proj.weight": self.gate.weight,
                p + "mlp.up_proj.weight": self.up.weight, p + "mlp.down_proj.weight": self.down.weight,
                p + "post_attention_layernorm.weight": self.ffn_norm}

