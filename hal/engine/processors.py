"""The step's logits processors: the `hal.ops.Ops.process_logits` arguments for the
decoding requests (or the requests whose prefill completes), built on the host from their
`SamplingParams` and generated tokens, moved to the device in one copy each. None when no
request uses a processor (the op is then skipped: plain requests pay nothing)."""

from __future__ import annotations

import torch

from hal.ops import SAMPLING_EPS


def processor_args(states, vocab: int, dev) -> dict | None:
    """``process_logits`` keyword arguments for ``states`` (in batch order), or None."""
    reqs = [s.req for s in states]
    if not any(r.processes_logits() for r in reqs):
        return None
    R, V = len(states), vocab
    gen = [s.tokens[len(s.req.prompt_ids):] for s in states]
    out = dict(penalties=None, token_counts=None, prompt_mask=None, bias=None, bad_words=None, bad_word_owner=None,
               history=None, stop_ids=None, min_tokens=None, min_p=None)
    if any(r.frequency_penalty or r.presence_penalty or r.repetition_penalty != 1 for r in reqs):
        out["penalties"] = torch.tensor([[r.frequency_penalty, r.presence_penalty, r.repetition_penalty]
                                         for r in reqs], dtype=torch.float32)
        out["token_counts"] = torch.stack([torch.bincount(torch.tensor(g, dtype=torch.long), minlength=V)[:V]
                                           for g in gen]).int()
        mask = torch.zeros(R, V, dtype=torch.bool)
        for i, r in enumerate(reqs):
            if r.repetition_penalty != 1:
                mask[i, torch.tensor(r.prompt_ids, dtype=torch.long)] = True
        out["prompt_mask"] = mask
    if any(r.logit_bias or r.allowed_token_ids is not None for r in reqs):
        bias = torch.zeros(R, V)
        for i, r in enumerate(reqs):
            if r.allowed_token_ids is not None:
                keep = torch.tensor(r.allowed_token_ids, dtype=torch.long)
                bias[i] = -torch.inf
                bias[i, keep] = 0.0
            for t, b in (r.logit_bias or {}).items():
                bias[i, t] = bias[i, t] + b
        out["bias"] = bias
    words = [(i, w) for i, r in enumerate(reqs) for w in r.bad_words]
    if words:
        L = max(len(w) for _, w in words)
        H = max(L - 1, 1)
        padded = torch.full((len(words), L), -1, dtype=torch.long)
        for j, (_, w) in enumerate(words):
            padded[j, L - len(w):] = torch.tensor(w, dtype=torch.long)
        hist = torch.full((R, H), -1, dtype=torch.long)
        for i, g in enumerate(gen):
            tail = g[-H:] if L > 1 else []
            if tail:
                hist[i, H - len(tail):] = torch.tensor(tail, dtype=torch.long)
        out.update(bad_words=padded, bad_word_owner=torch.tensor([i for i, _ in words], dtype=torch.long),
                   history=hist)
    left = [max(0, r.min_tokens - len(g)) for r, g in zip(reqs, gen)]
    if any(left):
        S = max(1, max(len(r.stop_ids) for r in reqs))
        stops = torch.full((R, S), -1, dtype=torch.long)
        for i, r in enumerate(reqs):
            if r.stop_ids:
                stops[i, :len(r.stop_ids)] = torch.tensor(r.stop_ids, dtype=torch.long)
        out.update(stop_ids=stops, min_tokens=torch.tensor(left, dtype=torch.long))
    if any(r.min_p for r in reqs):
        out["min_p"] = torch.tensor([[r.min_p, r.temperature if r.temperature >= SAMPLING_EPS else 0.0]
                                     for r in reqs], dtype=torch.float32)
    return {k: None if v is None else v.to(dev) for k, v in out.items()}
