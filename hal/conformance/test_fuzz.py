"""Property-based fuzz of every op (hypothesis, derandomized: a fixed seed in CI).

Three properties per op, each case under a watchdog (a hang fails the case):

* valid edge input (empty batches, zero-length drafts, slack ``max_k``, every dtype, -inf
  logits, padding slots, ...) gives the oracle's answer: exactly for the deterministic
  ops and outputs, and the contract's structure for the random draws;
* non-contiguous input (every tensor argument a strided view of the same values, caches
  head-padded) gives exactly the backend's own answer on contiguous input;
* bad input (one argument broken: shape, dtype, device, type, NaN/Inf, a range, a sum, a
  huge size, aliased caches) raises `hal.HalError` naming that argument and leaves the
  KV caches untouched.

``HAL_FUZZ_EXAMPLES`` sets the examples per op and property (default 50); ``python -m hal
conformance --backend X --fuzz N`` runs N cases in all. Figures are printed at the end.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hal
from hal.backend import Backend
from hal.ops import OP_NAMES

EXAMPLES = int(os.environ.get("HAL_FUZZ_EXAMPLES", "50"))
WATCHDOG_S = float(os.environ.get("HAL_FUZZ_WATCHDOG", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
STATS: dict[str, int] = {"cases": 0, "refused with HalError": 0, "equal to the oracle": 0,
                         "strided equal to contiguous": 0, "other exceptions": 0, "hangs": 0, "wrong results": 0}


class Hang(Exception):
    pass


@contextlib.contextmanager
def watchdog(seconds: float = WATCHDOG_S):
    """Raise `Hang` in this (main) thread when the block runs longer than ``seconds``."""
    def fire(*_):
        raise Hang(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def checked(be) -> Backend:
    """The backend with value checks on (HAL_CHECK=1), as a plugin on a device would run them."""
    b = Backend(be.spec, be.impl)
    b.check_values = True
    return b


def run(fn, *args):
    try:
        with watchdog():
            return fn(*args)
    except Hang:
        STATS["hangs"] += 1
        raise
    except hal.HalError:
        raise
    except Exception:
        STATS["other exceptions"] += 1
        raise


# -- valid edge arguments ------------------------------------------------------------------------

FLOAT = st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float64])
INT = st.sampled_from([torch.int64, torch.int32])


def _probs(g, rows, V, dtype, zeros):
    p = torch.rand(rows, V, generator=g, dtype=torch.float64) ** 3
    p = p.masked_fill(torch.rand(rows, V, generator=g) < zeros, 0)
    p[:, 0] += 1e-3
    return (p / p.sum(-1, keepdim=True)).to(dtype)


def _logits(g, rows, V, dtype, masked):
    x = (torch.randn(rows, V, generator=g, dtype=torch.float64) * 4).to(dtype)
    if dtype in (torch.float16, torch.bfloat16):
        x = x.round()   # coarse values: exact ties
    m = torch.rand(rows, V, generator=g) < masked
    m[:, 0] = False
    return x.masked_fill(m, -math.inf)


def bs_of(be):
    return next(b for b in (16, 32, 64, 128) if b in be.spec.block_sizes)


@st.composite
def valid_case(draw, be, op):
    """``(args dict, V)`` of a valid call of ``op`` on ``be``'s device (values on the host)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))
    R = draw(st.sampled_from([0, 1, 1, 2, 3, 5]))
    V = draw(st.sampled_from([1, 2, 3, 8, 33]))
    ks = [draw(st.integers(0, 4)) for _ in range(R)]
    max_k = max(ks, default=0) + draw(st.sampled_from([0, 0, 1, 3]))
    N, it, ft = sum(ks), draw(INT), draw(FLOAT)
    ids = torch.randint(0, V, (N,), generator=g).to(it)
    cu = torch.tensor([0] + ks).cumsum(0).to(it)
    so = dict(seeds=torch.randint(-2 ** 62, 2 ** 62, (R,), generator=g),
              offsets=torch.randint(0, 2 ** 40, (R,), generator=g))
    zeros = draw(st.sampled_from([0.0, 0.5]))
    if op == "sample":
        temp = torch.rand(R, generator=g) * 2
        temp[torch.rand(R, generator=g) < 0.3] = 0
        return dict(logits=_logits(g, R, V, ft, zeros), temperature=temp,
                    top_k=torch.randint(-1, V + 2, (R,), generator=g).to(torch.int32),
                    top_p=torch.rand(R, generator=g).clamp(min=0.05).where(torch.rand(R, generator=g) < 0.5,
                                                                            torch.ones(R)), **so), V
    if op == "ngram_propose":
        L = draw(st.sampled_from([0, 1, 4, 12]))
        hist = torch.randint(0, draw(st.sampled_from([2, 3, 50])), (R, L), generator=g).to(it)
        n = draw(st.integers(1, 6))
        lo = draw(st.integers(1, n))
        return dict(token_ids=hist, num_tokens=torch.randint(0, L + 1, (R,), generator=g).to(draw(INT)),
                    min_n=lo, max_n=n, k=draw(st.integers(1, 6))), V
    if op == "verify_greedy":
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, target_logits=_logits(g, N + R, V, ft, zeros),
                    max_k=max_k), V
    if op == "verify_rejection":
        dp = _probs(g, N, V, ft, zeros) if draw(st.booleans()) else None
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, draft_probs=dp,
                    target_probs=_probs(g, N + R, V, ft, zeros), **so, max_k=max_k), V
    if op == "verify_rejection_logits":
        dp = _probs(g, N, V, ft, zeros) if draw(st.booleans()) else None
        temp = torch.rand(R, generator=g) * 2
        temp[torch.rand(R, generator=g) < 0.4] = 0
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, draft_probs=dp,
                    target_logits=_logits(g, N + R, V, ft, zeros), temperature=temp, **so, max_k=max_k), V
    if op == "verify_typical":
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, target_probs=_probs(g, N + R, V, ft, zeros), **so,
                    max_k=max_k, posterior_threshold=draw(st.sampled_from([0.09, 0.3, 1.0])),
                    posterior_alpha=draw(st.sampled_from([0.3, 1.0]))), V
    if op == "verify_tree":
        parents = torch.cat([torch.randint(-1, max(i, 0), (1,), generator=g) if i else torch.tensor([-1])
                             for k in ks for i in range(k)]).to(it) if N else torch.zeros(0, dtype=it)
        if draw(st.booleans()):
            return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, parent_ids=parents,
                        target=_logits(g, N + R, V, ft, zeros), draft_probs=None, seeds=None, offsets=None,
                        max_k=max_k), V
        dp = _probs(g, N, V, ft, zeros) if draw(st.booleans()) else None
        return dict(draft_token_ids=ids, cu_num_draft_tokens=cu, parent_ids=parents,
                    target=_probs(g, N + R, V, ft, zeros), draft_probs=dp, **so, max_k=max_k), V
    bs = bs_of(be)
    nb = draw(st.integers(1, 4))
    H, D = draw(st.sampled_from([1, 2])), 16
    cdt = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    caches = dict(k_cache=torch.randn(nb, bs, H, D, generator=g).to(cdt),
                  v_cache=torch.randn(nb, bs, H, D, generator=g).to(cdt))
    nslots = nb * bs
    if op == "write_kv":
        T = draw(st.integers(0, min(6, nslots)))
        slots = torch.randperm(nslots, generator=g)[:T]
        slots[torch.rand(T, generator=g) < 0.3] = -1
        return dict(key=torch.randn(T, H, D, generator=g).to(ft), value=torch.randn(T, H, D, generator=g).to(ft),
                    **caches, slot_mapping=slots.to(it)), V
    if op == "copy_kv":
        M = draw(st.integers(0, min(6, nslots)))
        return dict(**caches, src_slots=torch.randint(0, nslots, (M,), generator=g).to(it),
                    dst_slots=torch.randperm(nslots, generator=g)[:M].to(it)), V
    assert op == "paged_attention"
    width = draw(st.integers(1, 3))
    seq = torch.randint(1, width * bs + 1, (R,), generator=g)
    ql = torch.minimum(torch.randint(1, 5, (R,), generator=g), seq)
    if draw(st.booleans()):
        ql = torch.ones(R, dtype=torch.long)        # decode
    T = int(ql.sum())
    bt = torch.randint(0, nb, (R, width), generator=g).to(torch.int32)
    bt[:, 1:] = torch.where(torch.rand(R, width - 1, generator=g) < 0.2, 10 ** 6, bt[:, 1:])   # unused: never read
    used = torch.arange(width)[None] * bs < seq[:, None]
    bt = torch.where(used, bt.clamp(max=nb - 1), bt)
    tm = None
    if draw(st.booleans()) and R:
        tm = torch.rand(T, int(ql.max()), generator=g) < 0.5
        qs = torch.cat([torch.zeros(1, dtype=torch.long), ql.cumsum(0)])
        for r in range(R):
            tm[qs[r]:qs[r + 1], :int(ql[r])] |= torch.eye(int(ql[r]), dtype=torch.bool)
    return dict(query=torch.randn(T, H * draw(st.sampled_from([1, 2])), D, generator=g).to(cdt), **caches,
                block_tables=bt, seq_lens=seq.to(it), query_start_loc=torch.cat([torch.zeros(1), ql.cumsum(0)]).to(it),
                scale=D ** -0.5, tree_mask=tm), V


def on(be, args):
    return {k: v.to(be.device_type) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def call(be, op, args):
    return getattr(be, op)(*args.values())


def outputs(op, args, result):
    """What to compare: returned tensors, and the caches for the in-place ops (on the host)."""
    if op in ("write_kv", "copy_kv"):
        return [args["k_cache"].cpu(), args["v_cache"].cpu()]
    return [t.cpu() for t in (result if isinstance(result, tuple) else (result,))]


def _structure(op, args, got, V):
    """The contract's structure of a verify/sample result whose draws may differ from the oracle's."""
    if op == "sample":
        tok, q = got
        assert tok.dtype == torch.int32 and q.dtype == torch.float32
        assert ((tok >= 0) & (tok < V)).all()
        if tok.numel():
            assert (q.gather(1, tok.long()[:, None]) > 0).all(), "a token of probability 0 was drawn"
        return
    out, n = got[0], got[-1]
    cu = args["cu_num_draft_tokens"].long()
    R, max_k = cu.shape[0] - 1, args["max_k"]
    assert out.shape == (R, max_k + 1) and out.dtype == torch.int32 and n.dtype == torch.int32
    k = cu[1:] - cu[:-1]
    assert ((n >= 0) & (n <= k)).all()
    pos = torch.arange(max_k + 1)[None]
    assert torch.equal(out >= 0, pos <= n[:, None].long()), "rows hold n_accepted + 1 tokens, then -1"
    assert (out < V).all()
    if op != "verify_tree":
        ids = args["draft_token_ids"].long()
        for r in range(R):
            assert out[r, :int(n[r])].tolist() == ids[int(cu[r]):int(cu[r]) + int(n[r])].tolist()


TOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def _compare_to_oracle(op, args, got, want, V):
    random = op in ("sample", "verify_rejection", "verify_rejection_logits", "verify_typical") or (
        op == "verify_tree" and args.get("seeds") is not None)
    if op == "paged_attention":
        torch.testing.assert_close(got[0].double(), want[0].double(), atol=TOL[args["query"].dtype], rtol=0)
    elif op == "sample":
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
        greedy = args["temperature"] < hal.ops.SAMPLING_EPS
        assert torch.equal(got[0][greedy], want[0][greedy]), "greedy rows differ from the oracle"
        _structure(op, args, got, V)
    elif op == "verify_rejection_logits":
        greedy = args["temperature"] < hal.ops.SAMPLING_EPS
        assert all(torch.equal(a[greedy], b[greedy]) for a, b in zip(got, want)), "greedy requests differ from the oracle"
        _structure(op, args, got, V)
    elif random:
        _structure(op, args, got, V)
    else:
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{op}: differs from the oracle"


@pytest.mark.parametrize("op", OP_NAMES)
def test_fuzz_valid_edges_equal_the_oracle(backend, oracle, op):
    @FUZZ
    @given(data=st.data())
    def prop(data):
        args, V = data.draw(valid_case(backend, op))
        STATS["cases"] += 1
        mine, ref = on(backend, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}), \
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        got = outputs(op, mine, run(call, checked(backend), op, mine))
        want = outputs(op, ref, call(oracle, op, ref))
        try:
            _compare_to_oracle(op, ref, got, want, V)
        except AssertionError:
            STATS["wrong results"] += 1
            raise
        STATS["equal to the oracle"] += 1
    prop()


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view: every other element of a twice-as-long last
    dim (head-padding for caches), transposed for 2-D."""
    if t.dim() == 0 or t.numel() == 0:
        return t
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    if t.dim() >= 3:
        wide[..., :t.shape[-1]] = t          # head-padded: unit stride, padded rows
        return wide[..., :t.shape[-1]]
    wide[..., ::2] = t
    v = wide[..., ::2]
    return v.t().contiguous().t() if t.dim() == 2 and v.shape[0] % 2 else v   # column-major for odd rows


@pytest.mark.parametrize("op", OP_NAMES)
def test_fuzz_strided_equals_contiguous(backend, op):
    @FUZZ
    @given(data=st.data())
    def prop(data):
        args, _ = data.draw(valid_case(backend, op))
        STATS["cases"] += 1
        a = on(backend, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
        b = {k: strided(v) if isinstance(v, torch.Tensor) else v for k, v in on(backend, args).items()}
        want = outputs(op, a, run(call, checked(backend), op, a))
        got = outputs(op, b, run(call, checked(backend), op, b))
        for x, y in zip(got, want):
            if not torch.equal(x, y):
                STATS["wrong results"] += 1
                raise AssertionError(f"{op}: strided input gives a different result")
        STATS["strided equal to contiguous"] += 1
    prop()


# -- bad arguments ---------------------------------------------------------------------------------

def _breaks(op, name, v, args, V):
    """Ways to break argument ``name`` (value ``v``) that the contract refuses."""
    out = ["type"]
    if isinstance(v, torch.Tensor):
        out += ["ndim", "dtype", "device"]
        if v.is_floating_point() and v.numel() and name not in ("temperature", "top_p", "k_cache", "v_cache"):
            out += ["nan"]
        if name in ("temperature",) and v.numel():
            out += ["negative"]
        if name == "top_p" and v.numel():
            out += ["zero"]
        if name in ("draft_token_ids", "slot_mapping", "src_slots", "dst_slots") and v.numel():
            out += ["too_big", "too_small"]
        if name == "cu_num_draft_tokens" and v.numel() > 1 and int(v[-1]) > 0:
            out += ["cu_start"]
        if name in ("target_probs", "draft_probs") and v.numel() or (name == "target" and args.get("seeds") is not None
                                                                   and v.numel()):
            out += ["unnormalised"]
        if name == "k_cache":
            out += ["alias"]
        if name == "offsets" and v.numel():
            out += ["negative"]
    elif name in ("max_k", "k", "max_n", "min_n"):
        out += ["huge", "negative"]
    elif name in ("scale", "posterior_threshold", "posterior_alpha"):
        out += ["nan", "negative"]
    return out


def _broken(how, name, v, args):
    if how == "type":
        return v.tolist() if isinstance(v, torch.Tensor) else "nonsense", name
    if how == "ndim":
        return v.unsqueeze(0), name
    if how == "dtype":
        return (v.to(torch.int32) if v.is_floating_point() or v.dtype == torch.bool else v.to(torch.float32)), name
    if how == "device":
        return v.to("meta"), name
    if how == "nan":
        if not isinstance(v, torch.Tensor):
            return math.nan, name
        v = v.clone()
        v.view(-1)[-1] = math.nan
        return v, name
    if how == "negative":
        if isinstance(v, torch.Tensor):
            return v * 0 - 1, name
        return -1, name
    if how == "zero":
        return v * 0, name
    if how == "too_big":
        return v + 10 ** 6, name
    if how == "too_small":
        return v * 0 - 2, name
    if how == "cu_start":
        v = v.clone()
        v[0] = 1
        return v, name
    if how == "unnormalised":
        return v * 1.5 + 0.01, name
    if how == "huge":
        return 2 ** 40, name
    if how == "alias":
        return v, "v_cache"          # v_cache := k_cache below
    raise AssertionError(how)


@pytest.mark.parametrize("op", OP_NAMES)
def test_fuzz_bad_input_is_refused(backend, op):
    @FUZZ
    @given(data=st.data())
    def prop(data):
        args, V = data.draw(valid_case(backend, op))
        STATS["cases"] += 1
        args = on(backend, args)
        names = [n for n, v in args.items() if v is not None]
        name = data.draw(st.sampled_from(names))
        how = data.draw(st.sampled_from(_breaks(op, name, args[name], args, V)))
        bad, expect = _broken(how, name, args[name], args)
        args[name] = bad
        if how == "alias":
            args["v_cache"] = args["k_cache"]
        caches = [args[c].clone() for c in ("k_cache", "v_cache")
                  if isinstance(args.get(c), torch.Tensor) and args[c].device.type != "meta"]
        with pytest.raises(hal.HalError) as e:
            run(call, checked(backend), op, args)
        STATS["refused with HalError"] += 1
        assert e.value.arg == expect, f"{op} {name} broken by {how}: the error names {e.value.arg!r}: {e.value}"
        for before, c in zip(caches, ("k_cache", "v_cache")):
            if isinstance(args[c], torch.Tensor) and args[c].device.type != "meta":
                assert torch.equal(args[c].cpu(), before.cpu()), "a refused call touched the KV cache"
    prop()
