from __future__ import annotations

import torch
from torch import Tensor

from backends.ascend import _adapter
from hal.ops import SAMPLING_EPS
from verify_ops._common import SAMPLE, exponential32


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
           offsets: Tensor) -> tuple[Tensor, Tensor]:
    # z = (logits - max) / T filtered by torch_npu.npu_top_k_top_p; q = softmax(z); the token is
    # argmax(q / E), E ~ Exp(1) from the request's (seed, offset): no multinomial, no host sync.
    R, V = logits.shape
    greedy = temperature < SAMPLING_EPS
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    z = (x - torch.where(m > -torch.inf, m, 0.0)) / torch.where(greedy, 1.0, temperature)[:, None]
    q = _adapter.run(_adapter.top_k_top_p(z, top_k, top_p)).softmax(-1)
    top = logits.float().argmax(-1)
    q = torch.where(greedy[:, None], torch.zeros_like(q).scatter_(1, top[:, None], 1.0), q)
    noise = exponential32(seeds, offsets, SAMPLE, torch.arange(V, device=logits.device))
    return torch.where(greedy, top, (q / noise).argmax(-1)).int(), q
