"""The request-level engine (`SpeculativeDecoder.add_request / abort / step /
has_unfinished`): continuous batching, the token budget with chunked prefill, preemption,
abort, mixed greedy/sampled batches and logprobs, on a tiny random Llama (real ops)."""

import math
import random

import pytest
import torch

import hal
import hal.engine.router
from hal.conformance._helpers import assert_distribution
from hal.engine import Request, SamplingParams, SpeculativeDecoder
from hal.drafters import ModelDrafter, NgramDrafter
from hal.models.loaders import load_safetensors
from tests.launch.test_generate import tiny  # noqa: F401  (the fixture: a tiny random model folder)

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3],
           [11, 12, 11, 12, 11], [20, 21, 22, 23, 24, 25, 20, 21, 22, 23, 24, 25, 20, 21], [3, 3, 3]]
N = 12


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    return load_safetensors(tiny, hal.get_backend("cpu"))


def engine(model, drafter="ngram", **kw):
    d = NgramDrafter(model.be) if drafter == "ngram" else drafter
    return SpeculativeDecoder(model, d, **{"num_blocks": 64, **kw})


def alone(model, prompt, **params):
    return engine(model).generate([Request(prompt, max_new_tokens=N, k=3, **params)])[0]


@pytest.fixture(scope="module")
def singles(model):
    return [alone(model, p) for p in PROMPTS]


def test_requests_arriving_at_random_steps_match_running_alone(model, singles):
    rng = random.Random(4)
    for trial in range(3):
        dec = engine(model, max_num_batched_tokens=rng.choice([None, 12, 24]), max_num_seqs=4)
        pending, got, ids = list(enumerate(PROMPTS)), {}, {}
        rng.shuffle(pending)
        steps = 0
        while pending or dec.has_unfinished():
            while pending and rng.random() < 0.4:
                i, p = pending.pop()
                ids[dec.add_request(p, SamplingParams(max_new_tokens=N, k=3))] = i
            out = dec.step()
            for rid, toks in out.tokens.items():
                got.setdefault(ids[rid], []).extend(toks)
            steps += 1
            assert steps < 500, "the engine did not finish"
        assert [got[i] for i in range(len(PROMPTS))] == singles, f"trial {trial}: arrival order changed an output"
        assert dec.pool.allocator.num_free == dec.pool.allocator.num_blocks


@pytest.mark.parametrize("budget", [6, 9, 16])
def test_token_budget_is_never_exceeded(model, singles, budget):
    dec = engine(model, max_num_batched_tokens=budget, max_num_seqs=4)
    ids = [dec.add_request(p, SamplingParams(max_new_tokens=N, k=3)) for p in PROMPTS]
    got, fed = {rid: [] for rid in ids}, []
    while dec.has_unfinished():
        out = dec.step()
        fed.append(out.num_batched_tokens)
        for rid, toks in out.tokens.items():
            got[rid] += toks
    assert max(fed) <= budget, f"a step fed {max(fed)} tokens over a budget of {budget}"
    assert max(fed) == budget, "the budget was never used up (prefill must fill it)"
    assert [got[r] for r in ids] == singles
    # the 16-token prompt is longer than the smaller budgets: it was prefilled in chunks
    assert budget >= len(PROMPTS[2]) or sum(1 for f in fed if f == budget) >= 2


def test_preemption_under_a_tiny_pool(model, singles):
    dec = engine(model, num_blocks=4, block_size=16, max_num_seqs=6)   # 64 slots for 6 requests of up to 28
    outs = dec.generate([Request(p, max_new_tokens=N, k=3) for p in PROMPTS])
    assert dec.preemptions > 0 and dec.metrics.preemptions == dec.preemptions, "the test must preempt"
    assert outs == singles, "preemption (recompute) changed an output"
    assert dec.pool.allocator.num_free == 4 and all(r == 0 for r in dec.pool.allocator.refcount)


def test_abort_frees_target_and_draft_blocks(model):
    drafter = ModelDrafter(model.layer_view(1), num_blocks=32)
    dec = engine(model, drafter=drafter)
    a = dec.add_request(PROMPTS[0], SamplingParams(max_new_tokens=30, k=2))
    b = dec.add_request(PROMPTS[2], SamplingParams(max_new_tokens=30, k=2))
    for _ in range(3):
        dec.step()
    assert dec.pool.allocator.num_free < 64 and drafter.pool.allocator.num_free < 32
    assert dec.abort(a) and not dec.abort(a) and not dec.abort(12345)
    out = dec.step()
    assert a in out.finished and a not in out.tokens
    while dec.has_unfinished():
        dec.step()
    assert dec.pool.allocator.num_free == 64 and drafter.pool.allocator.num_free == 32
    assert dec.abort(b) is False


@pytest.mark.parametrize("sampled", [False, True])
def test_a_full_draft_pool_drops_drafts_not_requests(model, singles, sampled):
    """A draft pool with room for one request's chain: the others decode plainly that step
    (their draft caches freed, latest first); outputs as alone, both pools all free after."""
    drafter = ModelDrafter(model.layer_view(1), num_blocks=2, block_size=16)
    dec = engine(model, drafter=drafter, max_num_seqs=6)
    params = dict(temperature=0.7, seed=3) if sampled else {}
    outs = dec.generate([Request(p, max_new_tokens=N, k=3, **params) for p in PROMPTS])
    assert drafter.pool_full > 0, "the test must fill the draft pool"
    assert dec.metrics.total.num_draft_tokens > 0
    if not sampled:
        assert outs == singles
    assert all(len(o) == N for o in outs)
    assert dec.pool.allocator.num_free == 64 and drafter.pool.allocator.num_free == 2


def test_mixed_greedy_and_sampled_batch(model, singles):
    """Greedy rows equal greedy alone; sampled rows equal the same request alone (randomness
    is per request), so their law is the one the chi-square tests check for single runs."""
    params = [dict(), dict(temperature=0.8, seed=7), dict(), dict(temperature=1.2, top_k=5, seed=3), dict(),
              dict(temperature=0.5, top_p=0.9, seed=1)]
    dec = engine(model, max_num_batched_tokens=24, max_num_seqs=6)
    outs = dec.generate([Request(p, max_new_tokens=N, k=3, **kw) for p, kw in zip(PROMPTS, params)])
    for i, kw in enumerate(params):
        want = singles[i] if not kw else alone(model, PROMPTS[i], **kw)
        assert outs[i] == want, f"request {i} ({kw or 'greedy'}) differs from running alone"


def test_mixed_batches_keep_the_target_law():
    """A toy target with p = (0.7, 0.3) everywhere, sampled rows mixed with greedy rows in
    every step: the sampled tokens follow p (chi-square), greedy rows are all token 0."""
    from tests.engine.test_router import P2, Q2, ToyTarget, constant_drafter
    be = hal.get_backend("cpu")
    dec = SpeculativeDecoder(ToyTarget(be, P2), constant_drafter(be, Q2), num_blocks=16 * 16)
    reqs = [Request([0], max_new_tokens=120, temperature=1.0 if i % 2 else 0.0, seed=i, k=3) for i in range(16)]
    outs = dec.generate(reqs)
    assert all(t == 0 for o in outs[0::2] for t in o)
    assert_distribution(torch.tensor([t for o in outs[1::2] for t in o]), P2, "sampled rows in mixed batches")


def test_logprobs_match_log_softmax_of_the_target(model):
    from hal.engine.forward import forward
    from hal.kv import KVPool
    dec = engine(model)
    rid = dec.add_request(PROMPTS[0], SamplingParams(max_new_tokens=N, k=3, logprobs=3))
    toks, lps = [], []
    while dec.has_unfinished():
        out = dec.step()
        toks += out.tokens.get(rid, [])
        lps += out.logprobs.get(rid, [])
    assert len(lps) == len(toks) == N and dec.metrics.total.num_draft_tokens > 0
    full = PROMPTS[0] + toks
    pool = KVPool(model.be, 8, 16, model.cfg.kv_heads, model.cfg.head_dim, num_layers=model.cfg.layers)
    seq = pool.sequence()
    logits, _ = forward(model, pool, [seq], [full[:-1]], True)
    ref = torch.log_softmax(logits.float(), -1)[len(PROMPTS[0]) - 1:]
    for j, (t, e) in enumerate(zip(toks, lps)):
        assert e.token == t
        assert abs(e.logprob - float(ref[j, t])) < 1e-4, f"token {j}: {e.logprob} vs {float(ref[j, t])}"
        top = ref[j].topk(3)
        assert [i for i, _ in e.top] == top.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(e.top, top.values.tolist())) < 1e-4


@pytest.mark.parametrize("name,bad", [("prompt_ids", []), ("prompt_ids", [10 ** 6]), ("prompt_ids", [-1]),
                                      ("max_new_tokens", 0), ("k", -1), ("temperature", -0.5),
                                      ("temperature", float("nan")), ("top_p", 0.0), ("logprobs", 21),
                                      ("max_new_tokens", 10 ** 6)])
def test_bad_requests_are_refused(model, name, bad):
    dec = engine(model)
    prompt, params = [1, 2], SamplingParams()
    if name == "prompt_ids":
        prompt = bad
    else:
        setattr(params, name, bad)
    with pytest.raises(hal.HalError) as e:
        dec.add_request(prompt, params)
    assert str(e.value).startswith(name if name != "max_new_tokens" or bad == 0 else "prompt_ids")
    assert not dec.has_unfinished()


def test_engine_settings_are_checked(model):
    with pytest.raises(hal.HalError, match="max_num_batched_tokens"):
        engine(model, max_num_batched_tokens=2, max_num_seqs=4)
    with pytest.raises(hal.HalError, match="max_num_seqs"):
        engine(model, max_num_seqs=0)


def test_profiling_goes_through_the_synchronize_hook(model):
    """Device launches are asynchronous: every timing of the router's profiler is bracketed
    by the backends' `synchronize` (cuda: torch.cuda.synchronize, npu: torch.npu.synchronize)."""
    import dataclasses

    from hal.backend import Backend
    calls = []
    cpu = hal.get_backend("cpu")
    counting = Backend(dataclasses.replace(cpu.spec, synchronize=lambda: calls.append(1)), cpu.impl)
    model.be = counting
    try:
        dec = engine(model)
        dec.drafter.be = counting
        dec.profile_costs(max_tokens=3, context=32, reps=2)
    finally:
        model.be = cpu
    # 2 syncs per timed call: verify points 1, 2, 3 + the two attention points + 4 draft chain points, 2 reps each
    assert len(calls) == 2 * 2 * (3 + 2 + 4)
    assert hal.get_backend("cpu").spec.synchronize() is None


def test_target_probs_equal_what_every_backend_samples_from():
    """Verification takes p from `target_probs` (no draw, no offset spent): the same q that
    each backend's `sample` returns, within 1e-5."""
    from hal.engine.forward import target_probs
    g = torch.Generator().manual_seed(5)
    R, V = 12, 40
    logits = torch.randn(R, V, generator=g) * 3
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3] * 3)
    top_k = torch.tensor([0, 5, -1, 12] * 3, dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0] * 3)
    p = target_probs(logits, temp, top_k, top_p)
    assert torch.allclose(p.sum(-1), torch.ones(R), atol=1e-5)
    for b in hal.list_backends():
        if b.available and not b.name.startswith("mutant"):
            be = hal.get_backend(b.name)
            _, q = be.sample(logits, temp, top_k, top_p, torch.arange(R), torch.zeros(R, dtype=torch.long))
            torch.testing.assert_close(p, q.cpu(), atol=1e-5, rtol=0)


class BadDrafter(NgramDrafter):
    """PLANTED: a third-party drafter that breaks the Proposal contract in one field."""

    def __init__(self, be, how, lookahead):
        super().__init__(be)
        self.how, self.lookahead = how, lookahead

    def propose(self, b):
        import dataclasses
        prop = super().propose(b)
        if self.how == "ids":
            return dataclasses.replace(prop, draft_token_ids=prop.draft_token_ids[1:])
        if self.how == "cu":
            return dataclasses.replace(prop, cu_num_draft_tokens=prop.cu_num_draft_tokens[:-1])
        if self.how == "valid-tuple":   # host ints: num_valid has one type, an int64 tensor
            return dataclasses.replace(prop, num_valid=tuple(b.k))
        if self.how == "valid-float":
            return dataclasses.replace(prop, num_valid=torch.tensor([float(k) for k in b.k]))
        return dataclasses.replace(prop, num_valid=torch.tensor([k + 1 for k in b.k]))


@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("how,field", [("ids", "draft_token_ids"), ("cu", "cu_num_draft_tokens"),
                                       ("valid", "num_valid"), ("valid-tuple", "Proposal.num_valid: expected None or "
                                                                                "an integer tensor"),
                                       ("valid-float", "Proposal.num_valid: expected None or an integer tensor")])
def test_a_malformed_proposal_is_refused_naming_the_field(model, how, field, lookahead):
    dec = engine(model, drafter=BadDrafter(model.be, how, lookahead))
    dec.add(Request(PROMPTS[0], max_new_tokens=N, k=3))
    with pytest.raises(hal.HalError, match=field):
        while dec.has_unfinished():
            dec.step()


def test_an_exact_tie_is_listed_in_the_greedy_order():
    """The outside trial's finding: on an exact tie the greedy token (argmax: the lower id)
    was listed second in the alternatives. A toy target with eight equal tokens: greedy emits
    token 0 and lists 0..3, in that order, each with logprob log(1/8)."""
    from tests.engine.test_router import ToyTarget
    be = hal.get_backend("cpu")
    dec = SpeculativeDecoder(ToyTarget(be, torch.full((8,), 0.125)), None, num_blocks=16)
    rid = dec.add_request([0], SamplingParams(max_new_tokens=3, k=0, logprobs=4))
    lps = []
    while dec.has_unfinished():
        lps += dec.step().logprobs.get(rid, [])
    assert [e.token for e in lps] == [0, 0, 0]
    for e in lps:
        assert [i for i, _ in e.top] == [0, 1, 2, 3], e.top
        assert all(abs(v - math.log(0.125)) < 1e-6 for _, v in e.top)


def test_a_step_runs_in_inference_mode_and_its_tokens_equal_the_steps_without_it(model, singles):
    """`SpeculativeDecoder.step` runs the forward, the drafter and sampling in inference mode
    (per-op dispatch without autograd's bookkeeping); the same step body without the mode
    (``step.__wrapped__``) emits the same tokens, and tensors the mode made are still read
    after it (the next step, the caller)."""
    seen = []

    class Watching(NgramDrafter):
        def propose(self, batch):
            seen.append(torch.is_inference_mode_enabled())
            return super().propose(batch)

    for mode in (True, False):
        seen.clear()
        dec = engine(model, Watching(model.be))
        rid = dec.add_request(PROMPTS[0], SamplingParams(max_new_tokens=N, k=3))
        got = []
        while dec.has_unfinished():
            out = dec.step() if mode else SpeculativeDecoder.step.__wrapped__(dec)
            got += out.tokens.get(rid, [])
        assert got == singles[0]
        assert seen and set(seen) == {mode}, f"inference mode {mode}: the drafter saw {set(seen)}"
    seen.clear()   # the routing profile times drafts as steps run them (every entry point calls it)
    hal.engine.costs.profile_costs(model, Watching(model.be), engine(model).pool, max_tokens=9, context=16, reps=1)
    assert seen and set(seen) == {True}
    assert not torch.is_inference_mode_enabled()
