"""HF transformers: speculative generation with a transformers causal LM as the target,
our drafters proposing and our verify ops accepting.

HF's assisted generation plugs candidate generators into ``model.generate`` through
private hooks that change between releases, so this is a function with ``generate``-like
arguments instead (the documented route)::

    from hal.integrations.hf import generate
    out = generate(model, input_ids, drafter=NgramDrafter(hal.get_backend("cpu")), max_new_tokens=64, k=5)

Each round: the drafter reads the sequence (a `hal.engine.drafting.DraftBatch`, on its own
backend if it has one), the target scores ``[last token, drafts...]`` in one forward over
its KV cache, ``verify_greedy`` (or ``verify_rejection`` when sampling) keeps the accepted
prefix plus one token, and the cache is cropped back to the committed tokens. Greedy
output equals ``model.generate(do_sample=False)``; transformers is not imported here."""

from __future__ import annotations

import torch
from torch import Tensor

import hal
from hal.errors import HalError, arg_error
from hal.engine.forward import target_probs
from hal.devices import transfer
from hal.engine.drafting import DraftBatch
from hal.engine.requests import SamplingParams


def generate(model, input_ids: Tensor, *, drafter=None, backend=None, max_new_tokens: int = 20, k: int = 5,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_token_id: int | list[int] | None = None, stats: dict | None = None) -> Tensor:
    """``[1, prompt + new]`` token ids, as ``model.generate(input_ids, max_new_tokens=...)``
    returns them (one sequence; generation stops after an ``eos_token_id``, by default the
    model's ``generation_config.eos_token_id``, as HF's). ``stats``, when
    given, gains ``drafted`` and ``accepted`` counts."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1 or not input_ids.numel():
        raise arg_error("input_ids", "a [1, L] tensor of token ids with L >= 1",
                        list(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise arg_error("max_new_tokens", "an int >= 1", max_new_tokens)
    be = backend or hal.get_backend()
    dev = input_ids.device
    if eos_token_id is None:   # as HF's generate: the model's generation config
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, k=k)
    rows = lambda n: (torch.full((n,), float(temperature)), torch.full((n,), top_k, dtype=torch.int32),  # noqa
                      torch.full((n,), float(top_p)))
    tokens = input_ids[0].tolist()
    name = _cache_arg(model)
    out = model(input_ids, use_cache=True)
    cache, offset = getattr(out, name), 0
    tok, _ = be.sample(_on(be, out.logits[:, -1].float()), *map(lambda t: _on(be, t), rows(1)),
                       _on(be, torch.tensor([seed])), _on(be, torch.tensor([offset])))
    offset += 1
    new = [int(tok[0])]
    try:
        while len(new) < max_new_tokens and new[-1] not in eos:
            L = len(tokens) + len(new)
            room = min(k, max_new_tokens - len(new) - 1)
            drafts, q = _draft(drafter, params, tokens + new, room, offset) if drafter is not None and room else ([], None)
            offset += room
            fed = torch.tensor([[new[-1], *drafts]], device=dev)
            logits = model(fed, use_cache=True, **{name: cache}).logits[0].float()
            ids, cu = _on(be, torch.tensor(drafts, dtype=torch.long)), _on(be, torch.tensor([0, len(drafts)]))
            if temperature == 0:
                acc_out, n_acc = be.verify_greedy(ids, cu, _on(be, logits), len(drafts))
            else:
                p = target_probs(_on(be, logits), *map(lambda t: _on(be, t), rows(len(drafts) + 1)))
                acc_out, n_acc = be.verify_rejection(ids, cu, None if q is None else _on(be, q), p,
                                                     _on(be, torch.tensor([seed])), _on(be, torch.tensor([offset])),
                                                     len(drafts))
                offset += 1
            n = int(n_acc[0])
            if stats is not None:
                stats["drafted"] = stats.get("drafted", 0) + len(drafts)
                stats["accepted"] = stats.get("accepted", 0) + n
            if len(drafts) > n:   # keep the committed tokens but the newest (not yet fed): L + n
                cache.crop(n - len(drafts))   # negative: drop that many (every transformers version agrees)
            if drafter is not None:
                drafter.commit([0], [L + n])
            for t in acc_out[0, :n + 1].tolist():
                new.append(int(t))
                if t in eos or len(new) >= max_new_tokens:
                    break
    finally:
        if drafter is not None:
            drafter.release(0)
    return torch.tensor([tokens + new], device=dev)


def _cache_arg(model) -> str:
    """The KV-cache argument and output field: ``cache`` (transformers 5) or ``past_key_values``."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _on(be, t: Tensor) -> Tensor:
    return transfer(t, torch.device(be.device_type))


def _draft(drafter, params, history: list[int], k: int, offset: int) -> tuple[list[int], Tensor | None]:
    """The drafter's first valid drafts for one sequence (host ids) and their q rows."""
    h = torch.tensor([history], dtype=torch.long)
    prop = drafter.propose(DraftBatch(rids=(0,), params=(params,), history=h, num_tokens=torch.tensor([len(history)]),
                                      lengths=(len(history),), k=(k,), offsets=(offset,)))
    valid = prop.num_valid
    n = k if valid is None else int(valid[0])
    if not 0 <= n <= k:
        raise HalError(f"drafter: expected at most {k} valid drafts, got {n}")
    ids = prop.draft_token_ids[:n].cpu().tolist()
    q = None if prop.draft_probs is None else prop.draft_probs[:n].cpu().float()
    return ids, q
