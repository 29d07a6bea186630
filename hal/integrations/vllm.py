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
GREEDY_TEMPERATURE = -1.0   # older vLLM marks greedy rows so


def processors_from(sampling_metadata, R: int, V: int, dev) -> dict:
    """`hal.ops.Ops.process_logits` arguments from vLLM's ``SamplingMetadata`` fields
    (duck-typed; missing fields are off): ``no_penalties``, ``frequency_penalties``,
    ``presence_penalties``, ``repetition_penalties`` ``[R]``, ``output_token_ids`` (lists),
    ``prompt_token_ids`` ``[R, P]`` (padded with V), ``allowed_token_ids_mask`` ``[R, V]``
    (True: not allowed) and ``bad_words_token_ids`` ``{request: [[ids]]}``."""
    get = lambda name: getattr(sampling_metadata, name, None)  # noqa: E731
    out = dict(penalties=None, token_counts=None, prompt_mask=None, bias=None, bad_words=None, bad_word_owner=None,
               history=None, stop_ids=None, min_tokens=None, min_p=None)
    output = [list(map(int, t)) for t in (get("output_token_ids") or [[] for _ in range(R)])]
    if not (get("no_penalties") if get("no_penalties") is not None else get("frequency_penalties") is None):
        ones, zeros = torch.ones(R), torch.zeros(R)
        pick = lambda name, d: d if get(name) is None else torch.as_tensor(get(name)).float().cpu()  # noqa: E731
        out["penalties"] = torch.stack([pick("frequency_penalties", zeros), pick("presence_penalties", zeros),
                                        pick("repetition_penalties", ones)], 1)
        out["token_counts"] = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.long), minlength=V)[:V]
                                           for o in output]).int() if R else torch.zeros(0, V, dtype=torch.int32)
        mask = torch.zeros(R, V, dtype=torch.bool)
        if get("prompt_token_ids") is not None:
            ptoks = torch.as_tensor(get("prompt_token_ids")).long().cpu()
            rows = torch.arange(R)[:, None].expand_as(ptoks)
            keep = ptoks < V                                   # vLLM pads prompts with the vocabulary size
            mask[rows[keep], ptoks[keep]] = True
        out["prompt_mask"] = mask
    if get("allowed_token_ids_mask") is not None:
        out["bias"] = torch.where(torch.as_tensor(get("allowed_token_ids_mask")).cpu().bool(), -torch.inf, 0.0)
    words = [(r, list(map(int, w))) for r, ws in (get("bad_words_token_ids") or {}).items() for w in ws]
    if words:
        L = max(len(w) for _, w in words)
        padded = torch.full((len(words), L), -1, dtype=torch.long)
        for j, (_, w) in enumerate(words):
            padded[j, L - len(w):] = torch.tensor(w)
        H = max(L - 1, 1)
        hist = torch.full((R, H), -1, dtype=torch.long)
        for r, o in enumerate(output):
            tail = o[-H:] if L > 1 else []
            if tail:
                hist[r, H - len(tail):] = torch.tensor(tail)
        out.update(bad_words=padded, bad_word_owner=torch.tensor([r for r, _ in words]), history=hist)
    return {k: None if v is None else v.to(dev) for k, v in out.items()}


def rejection_sample(metadata, draft_probs: Tensor | None, logits: Tensor, bonus_token_ids: Tensor,
                     temperature: Tensor | None = None, top_k: Tensor | None = None, top_p: Tensor | None = None,
                     seeds: Tensor | None = None, offsets: Tensor | None = None, backend=None,
                     sampling_metadata=None) -> Tensor:
    """vLLM's ``RejectionSampler.forward`` output for ``metadata`` (``draft_token_ids [N]``,
    inclusive ``cu_num_draft_tokens [R]``, ``max_spec_len``), the target ``logits [N, V]`` at
    the draft positions and vLLM's ``bonus_token_ids [R, 1]``. ``temperature [R]`` (None: all
    greedy), optional ``top_k``/``top_p`` as vLLM's sampling metadata; randomness from
    ``seeds``/``offsets [R]`` (default: fresh seeds).

    One call of the backend's `verify_rejection_logits`: the logits are read once, never
    softmaxed whole. Only when ``top_k``/``top_p`` are given are the rows filtered first
    (``verify_ops.sample.filtered``: filtered-out tokens become -inf).

    ``sampling_metadata`` (vLLM's ``SamplingMetadata``, `processors_from`): its logits
    processors (penalties, allowed token ids, bad words) are applied to each draft row by the
    backend's `process_logits`, the drafts before the row counting as output, as vLLM's
    ``apply_logits_processors`` does; its ``temperature``/``top_k``/``top_p`` are used where
    the arguments are None. A draft id of -1 (vLLM's placeholder, a padded slot) ends that
    request's drafts: it and what follows are never accepted. A temperature of -1 (older
    vLLM's greedy mark) is greedy."""
    be = backend or hal.get_backend()
    dev = logits.device
    if sampling_metadata is not None:
        temperature = getattr(sampling_metadata, "temperature", None) if temperature is None else temperature
        top_k = getattr(sampling_metadata, "top_k", None) if top_k is None else top_k
        top_p = getattr(sampling_metadata, "top_p", None) if top_p is None else top_p
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
    temp = torch.zeros(R, device=dev) if temperature is None else temperature.to(dev).float()
    if bool((temp < 0).any()):
        if not bool(((temp == GREEDY_TEMPERATURE) | (temp >= 0)).all()):
            raise arg_error("temperature", "values >= 0, or -1 (older vLLM's greedy mark)", temp.tolist()[:8])
        temp = temp.clamp(min=0)
    # spec-hal's rows: request r's verified drafts, then one last row: vLLM's bonus (one-hot at
    # its bonus token) or, where a placeholder -1 cut the drafts, the target row at the placeholder
    keep, last, cut, k = _layout(ids, cu)
    ids = ids[keep]
    cu = torch.cat([cu.new_zeros(1), k.cumsum(0)])
    N2 = ids.numel()
    req = torch.arange(R, device=dev)
    draft_rows = torch.arange(N2, device=dev) + req.repeat_interleave(k, output_size=N2)
    last_rows = cu[1:] + req
    rows = torch.full((N2 + R, V), -torch.inf, device=dev, dtype=torch.float32)
    rows[draft_rows] = logits[keep].float()
    cut_t = torch.tensor(cut, dtype=torch.bool, device=dev)
    rows[last_rows[cut_t]] = logits[torch.tensor(last, dtype=torch.long, device=dev)[cut_t]].float()
    if sampling_metadata is not None:
        procs = processors_from(sampling_metadata, R, V, be.device_type)
        if any(v is not None for v in procs.values()):
            d = be.device_type
            rows = be.process_logits(rows.to(d), ids.to(d), cu.to(d), None, **procs,
                                     max_k=int(k.max()) if R else 0).to(dev)
    if top_k is not None or top_p is not None:
        per_row = lambda t, fill: (fill if t is None else t.to(dev)).repeat_interleave(  # noqa: E731
            k + 1, output_size=N2 + R)
        rows = filtered(rows, per_row(temp, None), per_row(top_k, torch.zeros(R, dtype=torch.int32, device=dev)).int(),
                        per_row(top_p, torch.ones(R, device=dev)).float())
        temp = torch.where(temp < SAMPLING_EPS, 0.0, 1.0)   # the rows are already divided by T
    bonus_rows = last_rows[~cut_t]
    rows[bonus_rows] = -torch.inf
    rows[bonus_rows, bonus[~cut_t]] = 0.0                   # only vLLM's bonus token finite
    q = None if draft_probs is None else draft_probs[keep]
    if seeds is None:
        seeds = torch.randint(-(1 << 62), 1 << 62, (R,), device=dev)
    offsets = torch.zeros(R, dtype=torch.long, device=dev) if offsets is None else offsets
    d = be.device_type
    out, _ = be.verify_rejection_logits(ids.to(d), cu.to(d), None if q is None else q.to(d), rows.to(d), temp.to(d),
                                        seeds.to(d), offsets.to(d), int(metadata.max_spec_len))
    return out.to(dev)


def _layout(ids: Tensor, cu: Tensor) -> tuple[Tensor, list[int], list[bool], Tensor]:
    """``(kept draft indices, each request's placeholder row (or -1), whether it was cut, drafts
    kept per request)``: a request's drafts end at its first -1 (vLLM's padded slot); any other
    negative id is refused. Without placeholders nothing is read to the host."""
    R = cu.numel() - 1
    if not bool((ids < 0).any()):
        return torch.arange(ids.numel(), device=ids.device), [-1] * R, [False] * R, cu[1:] - cu[:-1]
    bounds, vals = cu.tolist(), ids.tolist()
    keep, last, cut = [], [], []
    for a, b in zip(bounds, bounds[1:]):
        row = vals[a:b]
        m = row.index(PLACEHOLDER_TOKEN_ID) if PLACEHOLDER_TOKEN_ID in row else len(row)
        if any(t < 0 for t in row[:m]) or any(t < -1 for t in row):
            raise arg_error("draft_token_ids", f"token ids >= 0, or {PLACEHOLDER_TOKEN_ID} for a padded slot", row)
        keep += range(a, a + m)
        last.append(a + m if m < len(row) else -1)
        cut.append(m < len(row))
    counts = torch.tensor([(l if c else b) - a for a, b, l, c in zip(bounds, bounds[1:], last, cut)],
                          dtype=cu.dtype, device=cu.device)
    return torch.tensor(keep, dtype=torch.long, device=ids.device), last, cut, counts


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
