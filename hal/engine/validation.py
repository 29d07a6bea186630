"""The checks a request passes before it is queued (untrusted input: an HTTP client, another
process): `check_request`, each failure a `HalError` naming the field."""

from __future__ import annotations

import struct

from hal import kv
from hal.engine.requests import MAX_LOGPROBS, Request, StructuredOutputs
from hal.errors import HalError


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < float("inf")


def _check_processors(req: Request, V: int) -> None:
    """The logits processors' parameters (`SamplingParams`), each `HalError` naming the field."""
    for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0),
                         ("repetition_penalty", 1e-6, 100.0), ("min_p", 0.0, 1.0)):
        v = getattr(req, name)
        if not (_finite(v) and lo <= v <= hi):
            raise HalError(f"{name}: expected a number in [{lo}, {hi}], got {v!r}")
    if isinstance(req.min_tokens, bool) or not isinstance(req.min_tokens, int) or not 0 <= req.min_tokens < 1 << 31:
        raise HalError(f"min_tokens: expected an int >= 0, got {req.min_tokens!r}")
    tok = lambda t: isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V  # noqa: E731
    if req.logit_bias is not None and not (isinstance(req.logit_bias, dict) and all(
            tok(t) and _finite(b) and -100 <= b <= 100 for t, b in req.logit_bias.items())):
        raise HalError(f"logit_bias: expected {{token id in [0, {V}): bias in [-100, 100]}}, got "
                       f"{str(req.logit_bias)[:80]}")
    if req.allowed_token_ids is not None and not (req.allowed_token_ids and all(tok(t) for t in req.allowed_token_ids)):
        raise HalError(f"allowed_token_ids: expected a non-empty list of token ids in [0, {V}), got "
                       f"{list(req.allowed_token_ids)[:8]}")
    if not all(isinstance(w, (tuple, list)) and w and all(tok(t) for t in w) for w in req.bad_words):
        raise HalError(f"bad_words: expected non-empty token id sequences in [0, {V}), got {list(req.bad_words)[:4]}")


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def check_request(req: Request, vocab: int, allocator: kv.BlockAllocator) -> None:
    """`HalError` naming the field unless ``req`` can run: token ids in ``[0, vocab)``, sane
    parameters, and prompt + new tokens + drafts within the whole KV pool (else it could
    never run, even alone)."""
    V = vocab
    if not req.prompt_ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V
                                 for t in req.prompt_ids):
        raise HalError(f"prompt_ids: expected at least one token id in [0, {V}), got "
                       f"{list(req.prompt_ids)[:8]}{'...' if len(req.prompt_ids) > 8 else ''}")
    for name, lo, hi in (("max_new_tokens", 1, 1 << 63), ("k", 0, 1 << 63), ("top_k", -1, 1 << 31),
                         ("seed", -(1 << 63), 1 << 63)):
        v = getattr(req, name)   # top_k: an int32 in the step's tensors
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or v >= hi:
            raise HalError(f"{name}: expected an int in [{lo}, {hi - 1}], got {v!r}")
    if not (isinstance(req.temperature, (int, float)) and 0 <= req.temperature < float("inf")):
        raise HalError(f"temperature: expected a finite float >= 0, got {req.temperature!r}")
    if not (isinstance(req.top_p, (int, float)) and 0 < req.top_p <= 1 and _float32(req.top_p) > 0):
        raise HalError(f"top_p: expected a float in (0, 1] that is not 0 in float32 (as the step keeps it), "
                       f"got {req.top_p!r}")
    if req.logprobs is not None and (isinstance(req.logprobs, bool) or not isinstance(req.logprobs, int)
                                     or not 0 <= req.logprobs <= MAX_LOGPROBS):
        raise HalError(f"logprobs: expected None or an int in [0, {MAX_LOGPROBS}], got {req.logprobs!r}")
    _check_processors(req, V)
    if req.structured is not None:
        if not isinstance(req.structured, StructuredOutputs):
            raise HalError(f"structured: expected None or StructuredOutputs, got {type(req.structured).__name__}")
        if not req.stop_ids:
            raise HalError("structured: expected stop_ids (a grammar ends with a stop token), got none "
                           "(ignore_eos cannot be combined with a grammar)")
        if req.min_tokens:
            raise HalError(f"min_tokens: expected 0 with structured outputs (the grammar decides where the output "
                           f"ends), got {req.min_tokens}")
    bs, nb = allocator.block_size, allocator.num_blocks
    need = -(-(len(req.prompt_ids) + req.max_new_tokens + req.k) // bs)
    if need > nb:  # it could never run, even alone: refuse rather than preempt forever
        raise HalError(f"prompt_ids + max_new_tokens: expected at most {nb * bs - req.k} tokens (the KV pool "
                       f"holds {nb} blocks of {bs}), got {len(req.prompt_ids) + req.max_new_tokens}")
