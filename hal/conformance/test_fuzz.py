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

``HAL_FUZZ_EXAMPLES`` sets the examples per op and property (default 50, or a backend's
own `fuzz_examples`: 20 for cuda under the Triton interpreter, unless ``--slow``); ``python -m
hal conformance --backend X --fuzz N`` runs N cases in all. Figures are printed at the end.
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
from hal.conformance._cases import valid_case
from hal.ops import OP_NAMES

EXAMPLES = int(os.environ.get("HAL_FUZZ_EXAMPLES", "50"))
WATCHDOG_S = float(os.environ.get("HAL_FUZZ_WATCHDOG", "60"))


def fuzz(backend: Backend):
    """The hypothesis settings of ``backend``'s properties: `EXAMPLES` each, or the fewer its
    spec affords by default (`hal.backend.BackendSpec.fuzz_examples`: cuda under the Triton
    interpreter, where each example costs ~20x a native one) unless ``--slow`` (HAL_SLOW=1)
    or an explicit HAL_FUZZ_EXAMPLES asks for more. The planted ``cuda-ignores-strides``
    mutant is caught at the interpreter's count (tests/test_mutants.py)."""
    n = EXAMPLES
    if backend.spec.fuzz_examples and os.environ.get("HAL_SLOW") != "1" and "HAL_FUZZ_EXAMPLES" not in os.environ:
        n = min(n, backend.spec.fuzz_examples)
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
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


# -- valid edge arguments: hal/conformance/_cases.py -----------------------------------------------

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
    @fuzz(backend)
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
    @fuzz(backend)
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
    @fuzz(backend)
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
