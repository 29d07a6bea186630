"""vLLM v1's rejection-sampler layout on spec-hal's `verify_rejection_logits`.

vLLM (``vllm/v1/sample/rejection_sampler.py``) hands its sampler a ``SpecDecodeMetadata``
whose ``cu_num_draft_tokens`` is the *inclusive* prefix sum ``[R]`` (no leading 0), the
target logits at the draft positions ``[N, V]``, and the bonus tokens its own sampler drew
``[R, 1]``. It returns ``[R, max_spec_len + 1]`` int32 with ``PLACEHOLDER_TOKEN_ID`` (-1)
after the emitted tokens. Greedy requests (temperature below ``SAMPLING_EPS``) and random
ones may share a batch. This module does not import vLLM: any object with the same
attributes works, vLLM's own included.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

import hal
from hal.errors import arg_error
from hal.ops import SAMPLING_EPS
from verify_ops.sample import filtered

PLACEHOLDER_TOKEN_ID = -1


def rejection_sample(metadata, draft_probs: Tensor | None, logits: Tensor, bonus_token_ids: Tensor,
                     temperature: Tensor | None = None, top_k: Tensor | None = None, top_p: Tensor | None = None,
                     seeds: Tensor | None = None, offsets: Tensor | None = None, backend=None) -> Tensor:
    """vLLM's ``RejectionSampler.forward`` output for ``metadata`` (``draft_token_ids [N]``,
    inclusive ``cu_num_draft_tokens [R]``, ``max_spec_len``), the target ``logits [N, V]`` at
    the draft positions and vLLM's ``bonus_token_ids [R, 1]``. ``temperature [R]`` (None: all
    greedy), optional ``top_k``/``top_p`` as vLLM's sampling metadata; randomness from
    ``seeds``/``offsets [R]`` (default: fresh seeds).

    One call of the backend's `verify_rejection_logits`: the logits are read once, never
    softmaxed whole. Only when ``top_k``/``top_p`` are given are the rows filtered first
    (``verify_ops.sample.filtered``: filtered-out tokens become -inf)."""
    be = backend or hal.get_backend()
    dev = logits.device
    ids = torch.as_tensor(metadata.draft_token_ids, device=dev).long().reshape(-1)
    incl = torch.as_tensor(metadata.cu_num_draft_tokens, device=dev).long().reshape(-1)
    R, (N, V) = incl.numel(), logits.shape
    if ids.numel() != N or (R and int(incl[-1]) != N):
        raise arg_error("metadata.cu_num_draft_tokens", f"an inclusive prefix sum ending at {N} draft tokens "
                        "(vLLM's layout: no leading 0)", incl.tolist()[:8])
    bonus = torch.as_tensor(bonus_token_ids, device=dev).long().reshape(-1)
    if bonus.numel() != R:
        raise arg_error("bonus_token_ids", f"[{R}, 1]", list(bonus_token_ids.shape))
    cu = torch.cat([incl.new_zeros(1), incl])
    k = cu[1:] - cu[:-1]
    temp = torch.zeros(R, device=dev) if temperature is None else temperature.to(dev).float()
    z = logits
    if top_k is not None or top_p is not None:
        per_row = lambda t, fill: (fill if t is None else t.to(dev)).repeat_interleave(k, output_size=N)  # noqa: E731
        z = filtered(logits, per_row(temp, None), per_row(top_k, torch.zeros(R, dtype=torch.int32, device=dev)).int(),
                     per_row(top_p, torch.ones(R, device=dev)).float())
        temp = torch.where(temp < SAMPLING_EPS, 0.0, 1.0)   # z is already divided by T
    # spec-hal's target rows: request r's k_r draft rows, then its bonus row (only vLLM's bonus token finite)
    target = torch.full((N + R, V), -torch.inf, device=dev, dtype=torch.float32)
    req = torch.arange(R, device=dev)
    target[torch.arange(N, device=dev) + req.repeat_interleave(k, output_size=N)] = z.float()
    target[cu[1:] + req, bonus] = 0.0
    if seeds is None:
        seeds = torch.randint(-(1 << 62), 1 << 62, (R,), device=dev)
    offsets = torch.zeros(R, dtype=torch.long, device=dev) if offsets is None else offsets
    d = be.device_type
    out, _ = be.verify_rejection_logits(ids.to(d), cu.to(d), None if draft_probs is None else draft_probs.to(d),
                                        target.to(d), temp.to(d), seeds.to(d), offsets.to(d),
                                        int(metadata.max_spec_len))
    return out.to(dev)


class NgramProposer:
    """vLLM's prompt-lookup proposer interface (``vllm/v1/spec_decode/ngram_proposer.py``:
    ``prompt_lookup_min``, ``prompt_lookup_max``, ``num_speculative_tokens``, ``max_model_len``),
    on the backend's ``ngram_propose``: the longest suffix n-gram, its earliest match."""

    def __init__(self, min_n: int, max_n: int, k: int, max_model_len: int = 1 << 20, backend=None):
        self.min_n, self.max_n, self.k, self.max_model_len = min_n, max_n, k, max_model_len
        self.be = backend or hal.get_backend()

    def propose(self, context_token_ids):
        """Drafts for one request (``np.ndarray`` of token ids), or None when nothing matches."""
        out = self.propose_batch([context_token_ids])[0]
        return None if out is None else np.asarray(out, dtype=np.int64)

    def propose_batch(self, contexts) -> list[list[int] | None]:
        """Drafts per request (None where nothing matches), in one ``ngram_propose`` call."""
        R = len(contexts)
        L = max((len(c) for c in contexts), default=0)
        hist = torch.zeros(R, L, dtype=torch.long)
        for i, c in enumerate(contexts):
            hist[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
        n = torch.tensor([len(c) for c in contexts], dtype=torch.long)
        dev = self.be.device_type
        drafts, num = self.be.ngram_propose(hist.to(dev), n.to(dev), self.min_n, self.max_n, self.k)
        drafts, num = drafts.cpu().tolist(), num.cpu().tolist()
        room = [self.max_model_len - len(c) for c in contexts]   # vLLM never drafts past max_model_len
        return [d[:min(m, r)] if min(m, r) > 0 else None for d, m, r in zip(drafts, num, room)]
