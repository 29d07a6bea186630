"""Bad input: every op, every argument in turn, gets a wrong shape, dtype, device or
type and must raise HalError naming it. Value errors are checked with value checks
on (HAL_CHECK=1), and a rejected KV write must leave the cache untouched."""

import math

import pytest
import torch

import hal
import hal.conformance._helpers
from hal.conformance._helpers import bs_of
from hal.backend import Backend
from hal.ops import OP_NAMES

pytestmark = pytest.mark.hal_op(*OP_NAMES)


def valid_args(be, op):
    """A small valid call of ``op`` on ``be``: (dict of arguments, in order)."""
    d = be.device_type
    i32, i64 = torch.int32, torch.int64
    probs = lambda r: torch.full((r, 8), 1 / 8, device=d)  # noqa: E731
    ragged = dict(draft_token_ids=torch.tensor([1, 2, 3], device=d), cu_num_draft_tokens=torch.tensor([0, 1, 3],
                                                                                                      device=d))
    so = dict(seeds=torch.tensor([1, 2], device=d), offsets=torch.tensor([0, 0], device=d))
    bs = bs_of(be)
    caches = dict(k_cache=torch.zeros(4, bs, 2, 16, device=d), v_cache=torch.zeros(4, bs, 2, 16, device=d))
    if op == "sample":
        return dict(logits=torch.zeros(3, 8, device=d), temperature=torch.ones(3, device=d),
                    top_k=torch.zeros(3, dtype=i32, device=d), top_p=torch.ones(3, device=d),
                    seeds=torch.arange(3, device=d), offsets=torch.zeros(3, dtype=i64, device=d))
    if op == "ngram_propose":
        return dict(token_ids=torch.tensor([[1, 2, 1, 2, 0, 0], [3, 3, 3, 3, 3, 3]], device=d),
                    num_tokens=torch.tensor([4, 6], dtype=i32, device=d), min_n=1, max_n=2, k=3)
    if op == "verify_greedy":
        return dict(**ragged, target_logits=torch.zeros(5, 8, device=d), max_k=2)
    if op == "verify_rejection":
        return dict(**ragged, draft_probs=probs(3), target_probs=probs(5), **so, max_k=2)
    if op == "verify_rejection_logits":
        return dict(**ragged, draft_probs=probs(3), target_logits=torch.zeros(5, 8, device=d),
                    temperature=torch.tensor([0.0, 0.8], device=d), **so, max_k=2)
    if op == "verify_typical":
        return dict(**ragged, target_probs=probs(5), **so, max_k=2, posterior_threshold=0.09, posterior_alpha=0.3)
    if op == "verify_tree":
        return dict(**ragged, parent_ids=torch.tensor([-1, -1, 0], device=d), target=probs(5),
                    draft_probs=probs(3), **so, max_k=2)
    if op == "process_logits":
        from hal.conformance._cases import processors
        g = torch.Generator().manual_seed(0)
        args = processors(g, ragged["draft_token_ids"].cpu(), ragged["cu_num_draft_tokens"].cpu(), torch.zeros(5, 8),
                          torch.tensor([-1, -1, 0]), 2, dict.fromkeys(("penalties", "bias", "bad_words", "min_tokens",
                                                                       "min_p"), True))
        args["bad_word_owner"] = torch.zeros(args["bad_words"].shape[0], dtype=torch.long)
        return {k: v.to(d) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    if op == "write_kv":
        return dict(key=torch.ones(3, 2, 16, device=d), value=torch.ones(3, 2, 16, device=d), **caches,
                    slot_mapping=torch.tensor([0, -1, 5], device=d))
    if op == "paged_attention":
        return dict(query=torch.ones(3, 4, 16, device=d), **caches,
                    block_tables=torch.tensor([[0, 1], [2, 3]], dtype=i32, device=d),
                    seq_lens=torch.tensor([3, 1], device=d), query_start_loc=torch.tensor([0, 2, 3], device=d),
                    scale=0.25, tree_mask=torch.ones(3, 2, dtype=torch.bool, device=d))
    if op == "copy_kv":
        return dict(**caches, src_slots=torch.tensor([0, 1], device=d), dst_slots=torch.tensor([2, 3], device=d))
    raise AssertionError(f"no valid arguments for {op}")


def call(be, op, args):
    return getattr(be, op)(*args.values())


def wrong_dtype(t):
    return t.to(torch.int32) if t.is_floating_point() or t.dtype == torch.bool else t.to(torch.float32)


def _cases():
    ref = hal.conformance._helpers.oracle_backend()
    for op in OP_NAMES:
        for name, v in valid_args(ref, op).items():
            hows = ("shape", "dtype", "device", "type") if isinstance(v, torch.Tensor) else ("type",)
            yield from ((op, name, how) for how in hows)


CASES = list(_cases())


def test_valid_arguments_pass(backend):
    for op in OP_NAMES:
        call(backend, op, valid_args(backend, op))


@pytest.mark.parametrize("op,name,how", CASES, ids=[f"{o}-{n}-{h}" for o, n, h in CASES])
def test_each_argument_is_checked(backend, op, name, how):
    args = valid_args(backend, op)
    v = args[name]
    if not isinstance(v, torch.Tensor):
        args[name] = "nonsense"
    elif how == "shape":
        args[name] = v.unsqueeze(0)
    elif how == "dtype":
        args[name] = wrong_dtype(v)
    elif how == "device":
        args[name] = v.to("meta")
    else:
        args[name] = v.tolist()
    with pytest.raises(hal.HalError) as e:
        call(backend, op, args)
    assert e.value.arg == name, f"error names {e.value.arg!r}, not {name!r}: {e.value}"
    assert name in str(e.value) and "expected" in str(e.value) and "got" in str(e.value)


SCALARS = [("verify_greedy", "max_k", -1), ("verify_greedy", "max_k", 1.5), ("ngram_propose", "min_n", 0),
           ("ngram_propose", "max_n", 0), ("ngram_propose", "k", 0), ("paged_attention", "scale", math.nan),
           ("verify_typical", "posterior_threshold", 0.0), ("verify_typical", "posterior_alpha", 2.0),
           ("verify_rejection", "max_k", True), ("verify_rejection_logits", "max_k", 2 ** 40)]


@pytest.mark.parametrize("op,name,value", SCALARS)
def test_scalar_arguments(backend, op, name, value):
    args = valid_args(backend, op)
    args[name] = value
    with pytest.raises(hal.HalError) as e:
        call(backend, op, args)
    assert e.value.arg == name


def _nan(t):
    t = t.clone()
    t.view(-1)[0] = math.nan
    return t


def _unnorm(t):
    return t * 1.5


VALUES = [  # (op, argument, how to break its value, expected argument in the error)
    ("sample", "logits", _nan, "logits"),
    ("sample", "temperature", lambda t: -t, "temperature"),
    ("sample", "top_p", lambda t: t * 0, "top_p"),
    ("sample", "offsets", lambda t: t - 1, "offsets"),
    ("ngram_propose", "num_tokens", lambda t: t + 5, "num_tokens"),
    ("verify_greedy", "target_logits", _nan, "target_logits"),
    ("verify_greedy", "draft_token_ids", lambda t: t + 100, "draft_token_ids"),
    ("verify_greedy", "cu_num_draft_tokens", lambda t: t.flip(0), "cu_num_draft_tokens"),
    ("verify_greedy", "max_k", lambda k: 1, "max_k"),
    ("verify_rejection", "target_probs", _unnorm, "target_probs"),
    ("verify_rejection", "draft_probs", _nan, "draft_probs"),
    ("verify_rejection", "draft_probs", lambda t: t - 0.1, "draft_probs"),
    ("verify_rejection_logits", "target_logits", _nan, "target_logits"),
    ("verify_rejection_logits", "target_logits", lambda t: t.masked_fill(torch.arange(5, device=t.device)[:, None] == 4,
                                                                       -math.inf), "target_logits"),
    ("verify_rejection_logits", "temperature", lambda t: t - 1, "temperature"),
    ("verify_rejection_logits", "draft_probs", _unnorm, "draft_probs"),
    ("verify_rejection_logits", "draft_token_ids", lambda t: t + 100, "draft_token_ids"),
    ("verify_typical", "target_probs", _unnorm, "target_probs"),
    ("verify_tree", "parent_ids", lambda t: torch.tensor([0, -1, 1], device=t.device), "parent_ids"),
    ("verify_tree", "target", _nan, "target"),
    ("write_kv", "slot_mapping", lambda t: t + 1000, "slot_mapping"),
    ("write_kv", "slot_mapping", lambda t: torch.tensor([5, -1, 5], device=t.device), "slot_mapping"),
    ("write_kv", "key", _nan, "key"),
    ("paged_attention", "seq_lens", lambda t: t * 0, "seq_lens"),
    ("paged_attention", "block_tables", lambda t: t + 10, "block_tables"),
    ("paged_attention", "query_start_loc", lambda t: t * 2, "query_start_loc"),
    ("copy_kv", "dst_slots", lambda t: t * 0, "dst_slots"),
    ("copy_kv", "src_slots", lambda t: t + 10 ** 6, "src_slots"),
]


@pytest.mark.parametrize("op,name,breaker,expected", VALUES, ids=[f"{v[0]}-{v[1]}-{i}" for i, v in enumerate(VALUES)])
def test_value_checks(backend, monkeypatch, op, name, breaker, expected):
    monkeypatch.setenv("HAL_CHECK", "1")
    checked = Backend(backend.spec, backend.impl)
    args = valid_args(backend, op)
    args[name] = breaker(args[name])
    caches = [args[c].clone() for c in ("k_cache", "v_cache") if c in args]
    with pytest.raises(hal.HalError) as e:
        call(checked, op, args)
    assert e.value.arg == expected, str(e.value)
    for before, c in zip(caches, ("k_cache", "v_cache")):
        assert torch.equal(args[c], before), "a rejected call must not touch the KV cache"


def test_kv_pool_refuses_unsupported_geometry(backend):
    bad_bs = next(b for b in (3, 5, 7, 1 << 20) if b not in backend.spec.block_sizes)
    with pytest.raises(hal.HalError) as e:
        hal.KVPool(backend, num_blocks=2, block_size=bad_bs, num_kv_heads=1, head_dim=16)
    assert e.value.arg == "block_size"
