"""Argument checks run by `hal.Backend` before every op.

Shape, dtype and device checks always run. Value checks (NaN/Inf, index
ranges, probability sums) read tensor values, which costs a host sync on an
accelerator: they run when the backend declares ``always_check_values`` (cpu)
or when ``HAL_CHECK=1``. Every failure is a `HalError` naming the argument,
what was expected and what arrived.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hal.errors import arg_error
from hal.ops import SAMPLING_EPS

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int32, torch.int64)
I64 = (torch.int64,)
F32 = (torch.float32,)
# Size arguments are bounded, so that an absurd value is refused instead of allocating
# [R, max_k + 1] outputs or looping max_n times: k and max_k (drafts per request) and
# min_n / max_n (n-gram lengths) are at most these.
MAX_K = 1024
MAX_NGRAM = 1024
# Probability rows must sum to 1 within this absolute tolerance.
PROB_SUM_ATOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-3, torch.float64: 1e-3}


def _names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(be, name: str, t, dtypes, shape: tuple | None = None, ndim: int | None = None) -> Tensor:
    """Check type, device, dtype and shape (``None`` entries in ``shape`` are free)."""
    if not isinstance(t, Tensor):
        raise arg_error(name, "a torch.Tensor", type(t).__name__)
    if t.device.type != be.device_type:
        raise arg_error(name, f"a tensor on device type '{be.device_type}' (backend {be.name})", t.device)
    if t.dtype not in dtypes:
        raise arg_error(name, f"dtype {_names(dtypes)}", str(t.dtype).replace("torch.", ""))
    want = len(shape) if shape is not None else ndim
    if want is not None and t.dim() != want:
        raise arg_error(name, f"a {want}-D tensor{_shape_str(shape)}", f"shape {list(t.shape)}")
    if shape is not None and any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise arg_error(name, f"shape {_shape_str(shape, bare=True)}", f"shape {list(t.shape)}")
    return t


def _shape_str(shape, bare: bool = False) -> str:
    if shape is None:
        return ""
    s = "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"
    return s if bare else f" of shape {s}"


def same_device(named: dict) -> None:
    """All given tensors on one device."""
    first = None
    for name, t in named.items():
        if t is None:
            continue
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise arg_error(name, f"the same device as {first[0]} ({first[1]})", t.device)


def int_arg(name: str, v, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise arg_error(name, "a Python int", type(v).__name__)
    if v < lo or (hi is not None and v > hi):
        raise arg_error(name, f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]", v)
    return v


def float_arg(name: str, v, lo: float, hi: float, lo_open: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise arg_error(name, "a finite Python float", repr(v))
    if not ((v > lo if lo_open else v >= lo) and v <= hi):
        raise arg_error(name, f"a float in {'(' if lo_open else '['}{lo}, {hi}]", v)
    return float(v)


def _first_bad(mask: Tensor) -> int:
    return int(mask.reshape(-1).nonzero()[0, 0]) if mask.dim() else 0


def logits_values(name: str, t: Tensor, maxima: Tensor | None = None) -> Tensor | None:
    """No NaN or +inf (one pass: max propagates NaN); returns the row maxima (None when empty).
    ``maxima``: the rows' maxima where the caller has them already (``t.amax(-1)``'s values)."""
    if t.numel() == 0:
        return None
    mx = t.amax(-1) if maxima is None else maxima
    bad = torch.isnan(mx) | (mx == math.inf)
    if bool(bad.any()):
        raise arg_error(name, "no NaN or +inf (-inf marks masked tokens)", f"NaN/+inf in row {_first_bad(bad)}")
    return mx


def prob_values(name: str, t: Tensor) -> None:
    """Finite, non-negative rows summing to 1 within PROB_SUM_ATOL (two passes)."""
    if t.numel() == 0:
        return
    tol = PROB_SUM_ATOL[t.dtype]
    sums = t.sum(-1) if t.dtype in (torch.float32, torch.float64) else t.float().sum(-1)  # cascade summation
    err = (sums.double() - 1).abs()
    bad = ~(err <= tol)                                  # NaN and +inf land here too
    if bool(bad.any()) or float(t.amin()) < 0:
        if bool(bad.any()):
            row = _first_bad(bad)
            raise arg_error(name, f"finite non-negative rows summing to 1 within {tol}",
                            f"row {row} sums to {float(sums[row])}")
        raise arg_error(name, "finite, non-negative probabilities", f"a negative value ({float(t.amin()):.3g})")


def index_values(name: str, t: Tensor, lo: int, hi: int, what: str = "") -> None:
    """Every value in ``[lo, hi)``."""
    if t.numel() and bool(((t < lo) | (t >= hi)).any()):
        bad = t[(t < lo) | (t >= hi)][0]
        raise arg_error(name, f"values in [{lo}, {hi}){what}", f"{int(bad)}")


def cu_values(name: str, cu: Tensor, total: int, max_len: int | None, max_name: str = "max_k") -> None:
    """``cu`` is CSR prefix sums: starts at 0, non-decreasing, ends at ``total``."""
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        raise arg_error(name, f"prefix sums from 0 to {total}", f"{int(cu[0])}..{int(cu[-1])}")
    d = cu[1:] - cu[:-1]
    if d.numel() and bool((d < 0).any()):
        raise arg_error(name, "non-decreasing prefix sums", cu.tolist()[:16])
    if max_len is not None and d.numel() and int(d.max()) > max_len:
        raise arg_error(max_name, f"an int >= every per-request count ({int(d.max())})", max_len)


def temperature_values(temperature: Tensor) -> None:
    if bool((~torch.isfinite(temperature) | (temperature < 0)).any()):
        raise arg_error("temperature", "finite values >= 0", temperature[~(temperature >= 0)].tolist()[:4] or "inf")


def seeds_offsets(be, seeds, offsets, R: int) -> None:
    tensor(be, "seeds", seeds, I64, (R,))
    tensor(be, "offsets", offsets, I64, (R,))
    if be.check_values and offsets.numel() and bool((offsets < 0).any()):
        raise arg_error("offsets", "values >= 0", int(offsets.min()))


def _ragged(be, draft_token_ids, cu_num_draft_tokens, max_k) -> tuple[int, int]:
    tensor(be, "draft_token_ids", draft_token_ids, INTS, ndim=1)
    tensor(be, "cu_num_draft_tokens", cu_num_draft_tokens, INTS, ndim=1)
    if cu_num_draft_tokens.shape[0] < 1:
        raise arg_error("cu_num_draft_tokens", "shape [R+1] with R >= 0", "shape [0]")
    int_arg("max_k", max_k, 0, MAX_K)
    return draft_token_ids.shape[0], cu_num_draft_tokens.shape[0] - 1


def _ragged_values(be, draft_token_ids, cu, max_k, V) -> None:
    if be.check_values:
        cu_values("cu_num_draft_tokens", cu, draft_token_ids.shape[0], max_k)
        index_values("draft_token_ids", draft_token_ids, 0, V, " (token ids < V)")


def sample(be, logits, temperature, top_k, top_p, seeds, offsets) -> None:
    tensor(be, "logits", logits, FLOATS, ndim=2)
    R, V = logits.shape
    if V < 1:
        raise arg_error("logits", "a vocabulary of at least 1", f"shape {list(logits.shape)}")
    tensor(be, "temperature", temperature, F32, (R,))
    tensor(be, "top_k", top_k, INTS, (R,))
    tensor(be, "top_p", top_p, F32, (R,))
    seeds_offsets(be, seeds, offsets, R)
    same_device(dict(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, offsets=offsets))
    if be.check_values:
        logits_values("logits", logits)
        temperature_values(temperature)
        if bool((~(top_p > 0) | (top_p > 1)).any()):
            raise arg_error("top_p", "values in (0, 1]", top_p[~(top_p > 0) | (top_p > 1)].tolist()[:4])
        dead = (temperature >= SAMPLING_EPS) & (logits == -math.inf).all(-1)
        if bool(dead.any()):
            raise arg_error("logits", "a finite logit in every sampled row", f"row {_first_bad(dead)} all -inf")


def ngram_propose(be, token_ids, num_tokens, min_n, max_n, k) -> None:
    tensor(be, "token_ids", token_ids, INTS, ndim=2)
    tensor(be, "num_tokens", num_tokens, INTS, (token_ids.shape[0],))
    same_device(dict(token_ids=token_ids, num_tokens=num_tokens))
    int_arg("min_n", min_n, 1, MAX_NGRAM)
    if int_arg("max_n", max_n, 1, MAX_NGRAM) < min_n:
        raise arg_error("max_n", f"an int >= min_n ({min_n})", max_n)
    int_arg("k", k, 1, MAX_K)
    if be.check_values:
        index_values("num_tokens", num_tokens, 0, token_ids.shape[1] + 1)


def verify_greedy(be, draft_token_ids, cu_num_draft_tokens, target_logits, max_k) -> None:
    N, R = _ragged(be, draft_token_ids, cu_num_draft_tokens, max_k)
    tensor(be, "target_logits", target_logits, FLOATS, (N + R, None))
    same_device(dict(draft_token_ids=draft_token_ids, cu_num_draft_tokens=cu_num_draft_tokens,
                     target_logits=target_logits))
    _ragged_values(be, draft_token_ids, cu_num_draft_tokens, max_k, target_logits.shape[1])
    if be.check_values:
        logits_values("target_logits", target_logits)


def verify_rejection(be, draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, seeds,
                     offsets, max_k) -> None:
    N, R = _ragged(be, draft_token_ids, cu_num_draft_tokens, max_k)
    tensor(be, "target_probs", target_probs, FLOATS, (N + R, None))
    V = target_probs.shape[1]
    if draft_probs is not None:
        tensor(be, "draft_probs", draft_probs, FLOATS, (N, V))
    seeds_offsets(be, seeds, offsets, R)
    same_device(dict(draft_token_ids=draft_token_ids, cu_num_draft_tokens=cu_num_draft_tokens,
                     draft_probs=draft_probs, target_probs=target_probs, seeds=seeds, offsets=offsets))
    _ragged_values(be, draft_token_ids, cu_num_draft_tokens, max_k, V)
    if be.check_values:
        prob_values("target_probs", target_probs)
        if draft_probs is not None:
            prob_values("draft_probs", draft_probs)


def verify_rejection_logits(be, draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, temperature,
                            seeds, offsets, max_k) -> None:
    N, R = _ragged(be, draft_token_ids, cu_num_draft_tokens, max_k)
    tensor(be, "target_logits", target_logits, FLOATS, (N + R, None))
    V = target_logits.shape[1]
    if V < 1:
        raise arg_error("target_logits", "a vocabulary of at least 1", f"shape {list(target_logits.shape)}")
    if draft_probs is not None:
        tensor(be, "draft_probs", draft_probs, FLOATS, (N, V))
    tensor(be, "temperature", temperature, F32, (R,))
    seeds_offsets(be, seeds, offsets, R)
    same_device(dict(draft_token_ids=draft_token_ids, cu_num_draft_tokens=cu_num_draft_tokens,
                     draft_probs=draft_probs, target_logits=target_logits, temperature=temperature, seeds=seeds,
                     offsets=offsets))
    _ragged_values(be, draft_token_ids, cu_num_draft_tokens, max_k, V)
    if be.check_values:
        temperature_values(temperature)
        mx = logits_values("target_logits", target_logits)
        k = cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
        sampled = (temperature >= SAMPLING_EPS).repeat_interleave(k + 1, output_size=N + R)
        if mx is not None and bool((dead := sampled & (mx == -math.inf)).any()):
            raise arg_error("target_logits", "a finite logit in every row of a sampled request",
                            f"row {_first_bad(dead)} all -inf")
        if draft_probs is not None:
            prob_values("draft_probs", draft_probs)


def verify_typical(be, draft_token_ids, cu_num_draft_tokens, target_probs, seeds, offsets, max_k,
                   posterior_threshold, posterior_alpha) -> None:
    N, R = _ragged(be, draft_token_ids, cu_num_draft_tokens, max_k)
    tensor(be, "target_probs", target_probs, FLOATS, (N + R, None))
    seeds_offsets(be, seeds, offsets, R)
    float_arg("posterior_threshold", posterior_threshold, 0.0, 1.0)
    float_arg("posterior_alpha", posterior_alpha, 0.0, 1.0)
    same_device(dict(draft_token_ids=draft_token_ids, cu_num_draft_tokens=cu_num_draft_tokens,
                     target_probs=target_probs, seeds=seeds, offsets=offsets))
    _ragged_values(be, draft_token_ids, cu_num_draft_tokens, max_k, target_probs.shape[1])
    if be.check_values:
        prob_values("target_probs", target_probs)


def tree_parents(name: str, parent_ids: Tensor, cu: Tensor) -> None:
    """Every node's parent is -1 or a local index of an earlier node of its request (reads values)."""
    N = parent_ids.shape[0]
    local = torch.arange(N, device=parent_ids.device) - torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1],
                                                                               output_size=N)
    bad = (parent_ids < -1) | (parent_ids >= local)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise arg_error(name, "-1 or a local index of an earlier node", f"{int(parent_ids[i])} at node {int(local[i])}")


def verify_tree(be, draft_token_ids, cu_num_draft_tokens, parent_ids, target, draft_probs, seeds,
                offsets, max_k) -> None:
    N, R = _ragged(be, draft_token_ids, cu_num_draft_tokens, max_k)
    tensor(be, "parent_ids", parent_ids, INTS, (N,))
    tensor(be, "target", target, FLOATS, (N + R, None))
    V = target.shape[1]
    greedy = seeds is None
    if greedy:
        if offsets is not None:
            raise arg_error("offsets", "None in greedy mode (seeds is None)", "a tensor")
        if draft_probs is not None:
            raise arg_error("draft_probs", "None in greedy mode (seeds is None)", "a tensor")
    else:
        if offsets is None:
            raise arg_error("offsets", "a tensor when seeds is given", None)
        seeds_offsets(be, seeds, offsets, R)
        if draft_probs is not None:
            tensor(be, "draft_probs", draft_probs, FLOATS, (N, V))
    same_device(dict(draft_token_ids=draft_token_ids, cu_num_draft_tokens=cu_num_draft_tokens,
                     parent_ids=parent_ids, target=target, draft_probs=draft_probs, seeds=seeds,
                     offsets=offsets))
    _ragged_values(be, draft_token_ids, cu_num_draft_tokens, max_k, V)
    if be.check_values:
        tree_parents("parent_ids", parent_ids, cu_num_draft_tokens)
        if greedy:
            logits_values("target", target)
        else:
            prob_values("target", target)
            if draft_probs is not None:
                prob_values("draft_probs", draft_probs)


def kv_caches(be, k_cache, v_cache) -> None:
    tensor(be, "k_cache", k_cache, FLOATS, ndim=4)
    tensor(be, "v_cache", v_cache, (k_cache.dtype,), tuple(k_cache.shape))
    # data pointers are not traceable: while torch.compile traces, only the same tensor object is caught
    same = v_cache is k_cache if torch.compiler.is_compiling() else v_cache.data_ptr() == k_cache.data_ptr()
    if same and k_cache.numel():
        raise arg_error("v_cache", "a cache apart from k_cache (one allocation is fine, the same memory is not)",
                        "the same memory as k_cache")
    bs, D = k_cache.shape[1], k_cache.shape[3]
    if bs not in be.spec.block_sizes:
        raise arg_error("k_cache", f"block_size (dim 1) in {be.spec.block_sizes}", bs)
    if D % be.spec.head_dim_align:
        raise arg_error("k_cache", f"head_dim (dim 3) a multiple of {be.spec.head_dim_align}", D)


def write_kv(be, key, value, k_cache, v_cache, slot_mapping) -> None:
    kv_caches(be, k_cache, v_cache)
    _, _, H, D = k_cache.shape
    tensor(be, "key", key, FLOATS, (None, H, D))
    tensor(be, "value", value, FLOATS, tuple(key.shape))
    tensor(be, "slot_mapping", slot_mapping, INTS, (key.shape[0],))
    same_device(dict(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping))
    if be.check_values:
        index_values("slot_mapping", slot_mapping, -1, k_cache.shape[0] * k_cache.shape[1], " (-1 skips)")
        live = slot_mapping[slot_mapping >= 0]
        if live.unique().numel() != live.numel():
            raise arg_error("slot_mapping", "distinct slots (besides -1)", "a repeated slot")
        for name, t in (("key", key), ("value", value)):
            if not bool(torch.isfinite(t).all()):
                raise arg_error(name, "finite values", "NaN/Inf")


def paged_attention(be, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    tree_mask) -> None:
    kv_caches(be, k_cache, v_cache)
    nb, bs, Hkv, D = k_cache.shape
    tensor(be, "query", query, FLOATS, (None, None, D))
    T, Hq = query.shape[0], query.shape[1]
    if Hq % Hkv:
        raise arg_error("query", f"num_heads (dim 1) a multiple of num_kv_heads {Hkv}", Hq)
    tensor(be, "block_tables", block_tables, (torch.int32,), ndim=2)
    R = block_tables.shape[0]
    tensor(be, "seq_lens", seq_lens, INTS, (R,))
    tensor(be, "query_start_loc", query_start_loc, INTS, (R + 1,))
    float_arg("scale", scale, 0.0, math.inf)
    if tree_mask is not None:
        tensor(be, "tree_mask", tree_mask, (torch.bool,), (T, None))
    same_device(dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                     seq_lens=seq_lens, query_start_loc=query_start_loc, tree_mask=tree_mask))
    if be.check_values:
        cu_values("query_start_loc", query_start_loc, T, None)
        q_len = query_start_loc[1:] - query_start_loc[:-1]
        if bool((seq_lens < q_len).any()) or bool((seq_lens > block_tables.shape[1] * bs).any()):
            raise arg_error("seq_lens", f"q_len <= seq_len <= max_blocks*block_size ({block_tables.shape[1] * bs})",
                            seq_lens.tolist()[:8])
        used = torch.arange(block_tables.shape[1], device=seq_lens.device)[None] * bs < seq_lens[:, None]
        index_values("block_tables", block_tables[used], 0, nb, " (physical block ids)")
        if tree_mask is not None and R and int(q_len.max()) > tree_mask.shape[1]:
            raise arg_error("tree_mask", f"width >= the longest query ({int(q_len.max())})", tree_mask.shape[1])
        if not bool(torch.isfinite(query).all()):
            raise arg_error("query", "finite values", "NaN/Inf")


def copy_kv(be, k_cache, v_cache, src_slots, dst_slots) -> None:
    kv_caches(be, k_cache, v_cache)
    tensor(be, "src_slots", src_slots, INTS, ndim=1)
    tensor(be, "dst_slots", dst_slots, (src_slots.dtype,), tuple(src_slots.shape))
    same_device(dict(k_cache=k_cache, v_cache=v_cache, src_slots=src_slots, dst_slots=dst_slots))
    if be.check_values:
        n = k_cache.shape[0] * k_cache.shape[1]
        index_values("src_slots", src_slots, 0, n)
        index_values("dst_slots", dst_slots, 0, n)
        if dst_slots.unique().numel() != dst_slots.numel():
            raise arg_error("dst_slots", "distinct slots", "a repeated slot")
