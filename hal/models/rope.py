"""Rotary position embeddings: a cached table of unit rotations and their application to q / k."""

from __future__ import annotations

import torch
from torch import Tensor

from hal.errors import HalError


class Rope:
    """Rotary embeddings: a cached table of unit rotations and their application to q / k."""

    def __init__(self, head_dim: int, base: float, interleaved: bool, scaling: dict | None = None,
                 factors: tuple[float, ...] | None = None):
        half = head_dim // 2
        self.inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float64) / half))
        if factors is not None:   # a GGUF's rope_freqs (llama.cpp divides each frequency by its factor)
            if len(factors) != half:
                raise HalError(f"rope_freqs: expected {half} factors, got {len(factors)}")
            self.inv_freq = self.inv_freq / torch.tensor(factors, dtype=torch.float64)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":   # Llama 3.1: low frequencies slowed by `factor`, a smooth ramp between
            f, lo, hi, ctx = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                          "original_max_position_embeddings"))
            wavelen = 2 * torch.pi / self.inv_freq
            smooth = ((ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)
            self.inv_freq = (1 - smooth) * self.inv_freq / f + smooth * self.inv_freq
        elif kind != "default":
            raise HalError(f"rope_scaling: expected none or llama3, got {scaling!r}")
        self.interleaved = interleaved    # GGUF: pairs (2j, 2j+1); HF: pairs (j, j + D/2) (rotate_half)
        self.cache = torch.empty(0, half, dtype=torch.complex64)

    def to(self, device) -> "Rope":
        self.cache = self.cache.to(device)
        return self

    def __call__(self, positions: Tensor, max_position: int | None = None) -> Tensor:
        """Unit complex rotations [T, D/2] for the positions."""
        if max_position is not None:
            n = max_position + 1
        else:
            n = int(positions.max()) + 1 if positions.numel() else 0
        if self.cache.shape[0] < n:
            ang = torch.arange(max(n, 2 * self.cache.shape[0], 256), dtype=torch.float64)[:, None] * self.inv_freq
            self.cache = torch.polar(torch.ones_like(ang), ang).to(self.cache.device, torch.complex64)
        return self.cache[positions]

    def apply(self, x: Tensor, rot: Tensor) -> Tensor:
        """x [T, H, D]: rotate pairs (x_a, x_b) as complex numbers x_a + i x_b by the position's angle."""
        if self.interleaved:
            return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
                                      * rot[:, None]).flatten(-2)
        half = x.shape[-1] // 2
        z = torch.complex(x[..., :half].float(), x[..., half:].float()) * rot[:, None]
        return torch.cat([z.real, z.imag], -1)
