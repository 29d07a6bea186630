"""Structured outputs through the engine (`hal.engine.grammar`, llguidance): on a tiny random
model with a tiny byte-level tokenizer, every verified row is masked by the request's
grammar after the drafts on its path. Greedy speculative output equals plain greedy output
under the same grammar and is in the grammar's language; a draft the grammar forbids is
never accepted, even when it is the unmasked argmax; sampled output keeps the masked law."""

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hal
from hal.drafters import NgramDrafter
from hal.engine import Request, SpeculativeDecoder
from hal.engine.requests import StructuredOutputs
from hal.errors import HalError
from hal.models.loaders import load_safetensors
from tests.engine.test_processors import Oracle
from tests.launch.test_generate import tiny  # noqa: F401  (the fixture: a tiny random model folder)

pytest.importorskip("llguidance")
from hal.engine.grammar import GrammarCompiler  # noqa: E402

CHARS = list('{}":,[]') + list("abcdefghijklmnopqrstuvwxyz") + list("0123456789") + ["Ġ"] + list("ABCDE")
EOS = 0
SCHEMA = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["ab", "cd", "e"]}},
          "required": ["k", "tag"], "additionalProperties": False}
GRAMMARS = {
    "json": StructuredOutputs(json=json.dumps(SCHEMA)),
    "regex": StructuredOutputs(regex="[a-c]{2,5}x[0-9]"),
    "choice": StructuredOutputs(choice=("abc", "abd", "b", "dd")),
    "json_object": StructuredOutputs(json_object=True),
}
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2, 3], [9, 9, 9, 9], [11, 12, 13, 11, 12]]


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"<eos>": EOS, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    return load_safetensors(tiny, hal.get_backend("cpu"))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(tokenizer().to_str(), 50, (EOS,))


def text(ids):
    return tokenizer().decode([t for t in ids if t != EOS])


def in_language(name, s):
    if name == "json":
        v = json.loads(s)
        return set(v) == {"k", "tag"} and 0 <= v["k"] <= 99 and v["tag"] in ("ab", "cd", "e")
    if name == "regex":
        return re.fullmatch("[a-c]{2,5}x[0-9]", s) is not None
    if name == "choice":
        return s in ("abc", "abd", "b", "dd")
    return isinstance(json.loads(s), dict)


def run(model, compiler, drafter, name, k, n=40, **kw):
    dec = SpeculativeDecoder(model, drafter, num_blocks=256, grammar=compiler)
    outs = dec.generate([Request(p, max_new_tokens=n, k=k, stop_ids=(EOS,), structured=GRAMMARS[name], **kw)
                         for p in PROMPTS])
    return outs, dec


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_greedy_speculative_equals_plain_under_the_grammar(model, compiler, name):
    plain, _ = run(model, compiler, None, name, 0)
    spec, _ = run(model, compiler, NgramDrafter(model.be), name, 3)
    assert spec == plain
    oracle, dec = run(model, compiler, Oracle([p + o for p, o in zip(PROMPTS, plain)]), name, 4)
    assert oracle == plain
    tot = dec.metrics.total
    assert tot.num_accepted_tokens == tot.num_draft_tokens - 4 * len(PROMPTS) or tot.num_accepted_tokens > 0
    for out in plain:
        if out[-1] == EOS:
            assert in_language(name, text(out)), (name, text(out))
        else:
            assert name == "json_object", f"{name}: the grammar did not end within 40 tokens: {text(out)!r}"
    assert sum(o[-1] == EOS for o in plain) >= 3


@pytest.mark.parametrize("name", ["json", "regex", "choice"])
def test_a_forbidden_draft_is_never_accepted(model, compiler, name, monkeypatch):
    """The drafter is the target itself without the grammar: it drafts the unmasked greedy
    continuation, which the grammar forbids almost everywhere. The output is still plain's
    (each accepted draft is a token of it, so the grammar allowed it). The cut of
    deterministic drafts is off here, so that the forbidden drafts reach verification."""
    from hal.drafters import ModelDrafter
    from hal.engine import grammar
    monkeypatch.setattr(grammar, "constrain", lambda states, drafts, ks: drafts)
    plain, _ = run(model, compiler, None, name, 0)
    spec, dec = run(model, compiler, ModelDrafter(model, num_blocks=256), name, 4)
    assert spec == plain
    for out in spec:
        assert in_language(name, text(out))
    tot = dec.metrics.total
    assert tot.num_draft_tokens > 20 and tot.num_accepted_tokens < tot.num_draft_tokens


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_sampled_speculative_output_keeps_the_masked_law(model, compiler, drafter):
    """The text of 600 seeded requests under ``[a-e]{3}``, plain against speculative with
    drafts sampled from the unmasked target (each carries its q) or n-gram drafts (cut where
    the grammar forbids them); chi-square two-sample test, p > 1e-3."""
    from scipy.stats import chi2_contingency
    from hal.drafters import ModelDrafter
    spec_ = StructuredOutputs(regex="[a-e]{3}")
    prompt = [27, 28, 29, 27, 28, 29, 27, 28, 27, 28, 29, 27, 28, 29]   # letters: n-gram drafts find some

    def law(k):
        made = ModelDrafter(model, num_blocks=1024) if drafter == "model" else NgramDrafter(model.be)
        dec = SpeculativeDecoder(model, made if k else None, num_blocks=1024,
                                 max_num_seqs=64, grammar=compiler)
        outs = dec.generate([Request(prompt, max_new_tokens=6, k=k, seed=s, temperature=1.0, stop_ids=(EOS,),
                                     structured=spec_) for s in range(600)])
        return [text(o) for o in outs], dec
    plain, _ = law(0)
    spec, dec = law(3)
    assert all(re.fullmatch("[a-e]{3}", s) for s in plain + spec)
    assert dec.metrics.total.num_accepted_tokens > (50 if drafter == "model" else 20), "too few drafts accepted"
    keys = sorted(set(plain) | set(spec))
    table = [[plain.count(x) + 0.5 for x in keys], [spec.count(x) + 0.5 for x in keys]]
    assert chi2_contingency(table)[1] > 1e-3


def test_preempted_grammar_requests_match_running_alone(model, compiler):
    alone = [run(model, compiler, NgramDrafter(model.be), "json", 3)[0]]
    dec = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=16, block_size=4, max_num_seqs=4,
                             grammar=compiler)
    outs = dec.generate([Request(p, max_new_tokens=40, k=3, stop_ids=(EOS,), structured=GRAMMARS["json"])
                         for p in PROMPTS])
    assert dec.preemptions > 0 and outs == alone[0]


@pytest.mark.parametrize("spec,field", [
    (StructuredOutputs(regex="("), "structured.regex"),
    (StructuredOutputs(json='{"type": "nonsense"}'), "structured.json"),
    (StructuredOutputs(json='{"type": "string", "format": "made-up"}'), "structured.json"),
    (StructuredOutputs(json='{"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}'),
     "structured.json: expected a grammar llguidance accepts, got: Unimplemented keys"),
    (StructuredOutputs(json="{not json"), "structured.json"),
    (StructuredOutputs(choice=()), "structured"),
    (StructuredOutputs(regex="a", choice=("a",)), "structured"),
    (StructuredOutputs(choice=("a", "")), "structured.choice"),
    # compiles, and llguidance's lexer gives up once text is matched (issue 66: it failed mid-request)
    (StructuredOutputs(regex="a{1000000}"), "structured.regex: expected a grammar llguidance can match"),
])
def test_bad_grammars_are_refused_naming_the_field(model, compiler, spec, field):
    dec = SpeculativeDecoder(model, None, num_blocks=16, grammar=compiler)
    with pytest.raises(HalError, match=re.escape(field)) as e:
        dec.add(Request([1, 2], stop_ids=(EOS,), structured=spec))
    assert "\n" not in str(e.value) and "<state>" not in str(e.value)   # one line, not the parser's state
    assert not dec.has_unfinished()


def test_a_grammar_needs_a_compiler_and_a_stop_token(model, compiler):
    with pytest.raises(HalError, match="grammar compiler"):
        SpeculativeDecoder(model, None, num_blocks=16).add(Request([1, 2], stop_ids=(EOS,),
                                                                    structured=GRAMMARS["regex"]))
    dec = SpeculativeDecoder(model, None, num_blocks=16, grammar=compiler)
    with pytest.raises(HalError, match="ignore_eos"):
        dec.add(Request([1, 2], structured=GRAMMARS["regex"]))
    with pytest.raises(HalError, match="min_tokens"):
        dec.add(Request([1, 2], stop_ids=(EOS,), min_tokens=2, structured=GRAMMARS["regex"]))


def test_masks_cost_nothing_without_a_grammar(model):
    from hal.engine import grammar
    from hal.engine.requests import State
    from hal.kv import BlockAllocator, Sequence
    s = State(Request([1], k=0), 0, [1], Sequence(BlockAllocator(2, 4)))
    assert grammar.masks([s], [2], torch.tensor([1, 2]), None, 50, "cpu") is None


def test_a_mask_that_ignores_the_drafts_is_caught(model, compiler, monkeypatch):
    """The planted mutant masks every row as its request's first (ignoring the drafts before
    it): the unmasked target's drafts then slip through."""
    from hal.drafters import ModelDrafter
    from hal.engine import grammar
    from tests.mutants import mutate
    plain, _ = run(model, compiler, None, "json", 0)
    monkeypatch.setattr(grammar, "constrain", lambda states, drafts, ks: drafts)   # the forbidden drafts reach the rows
    monkeypatch.setattr(grammar, "_row_paths", mutate("grammar-ignores-drafts"))
    with pytest.raises(HalError, match="which it refused"):
        spec, _ = run(model, compiler, ModelDrafter(model, num_blocks=256), "json", 4)
        assert spec == plain   # not reached: the engine's own check refuses the token first


def test_deterministic_drafts_follow_the_grammar(compiler):
    """``grammar.constrain``: a request's n-gram drafts end at the first token its grammar
    forbids (``abx`` allowed by ``[a-c]{2,5}x[0-9]``, then ``q`` not), then take the tokens the
    grammar forces (``{"k":`` opens the JSON schema's object) up to its k; a request without a
    grammar keeps its drafts; random drafts (with their q) are never touched."""
    from hal.engine import grammar
    from hal.engine.requests import State
    from hal.engine.step_types import StepDrafts
    from hal.kv import BlockAllocator, Sequence
    tok = tokenizer()
    ids = lambda s: tok.encode(s).ids  # noqa: E731
    state = lambda rid, g: State(Request([1], stop_ids=(EOS,)), rid, [1], Sequence(BlockAllocator(2, 4)),  # noqa
                                 matcher=None if g is None else compiler.matcher(GRAMMARS[g]))
    a, b, c = state(0, "regex"), state(1, None), state(2, "json")
    drafts = StepDrafts(torch.tensor(ids("abxqa") + ids("qq") + ids("Zq")), [5, 2, 2], None, None, [], None,
                        [0, 0, 0])
    got = grammar.constrain([a, b, c], drafts, [5, 2, 6])
    assert got.counts == [3, 2, 5] and got.token_ids.tolist() == ids("abx") + ids("qq") + ids('{"k":') == got.host_ids
    sampled = StepDrafts(drafts.token_ids, [5, 2, 2], torch.ones(9, 50) / 50, None, [], None, [0, 0, 0])
    assert grammar.constrain([a, b, c], sampled, [5, 2, 6]) is sampled
    assert a.matcher.validate_tokens(ids("ab")) == 2 and c.matcher.validate_tokens(ids("{")) == 1, \
        "constrain left tokens in a matcher"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_left_without_tokens_fails_alone(model, compiler, temperature):
    """allowed_token_ids that the bad words (or the grammar) exclude entirely leave a row with
    no token: that request fails, named in `StepOutput.errors`, and a request in the same
    steps is what it is alone (it used to fail the whole step)."""
    ok = Request(PROMPTS[0], max_new_tokens=8, k=3, stop_ids=(EOS,), temperature=temperature, seed=3)
    alone = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64).generate([ok])[0]
    for bad in (Request(PROMPTS[1], max_new_tokens=8, allowed_token_ids=(5,), bad_words=((5,),),
                        temperature=temperature),
                Request(PROMPTS[1], max_new_tokens=8, stop_ids=(EOS,), temperature=temperature,
                        allowed_token_ids=(3, 4), structured=StructuredOutputs(choice=("b",)))):
        dec = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64, grammar=compiler)
        a, b = dec.add(ok), dec.add(bad)
        got, errors = [], {}
        while dec.has_unfinished():
            out = dec.step()
            got += out.tokens.get(a, [])
            errors.update(out.errors)
            assert b not in out.tokens, "a token of a row without any allowed token was emitted"
        assert got == alone and list(errors) == [b] and errors[b].startswith("allowed_token_ids: expected a token")
        assert dec.pool.allocator.num_free == dec.pool.allocator.num_blocks
        with pytest.raises(HalError, match=r"requests\[1\]: allowed_token_ids: expected a token"):
            dec.generate([ok, bad])


def _one_step_at_a_time(dec, rids):
    """Step ``dec`` to the end: each request's tokens and the errors of `StepOutput`."""
    got, errors = {r: [] for r in rids}, {}
    while dec.has_unfinished():
        out = dec.step()
        errors.update(out.errors)
        for r in rids:
            got[r] += out.tokens.get(r, [])
    return got, errors


@pytest.mark.parametrize("spec,field", [
    (StructuredOutputs(choice=("<eos>",)), "structured.choice"),
    (StructuredOutputs(choice=("a<eos>b",)), "structured.choice"),
    (StructuredOutputs(regex="<eos>"), "structured.regex"),
    (StructuredOutputs(json=json.dumps({"const": "<eos>"})), "structured.json"),
    (StructuredOutputs(json=json.dumps({"enum": ["a<eos>"]})), "structured.json"),
])
def test_a_grammar_that_needs_a_special_token_is_refused_at_compile_time(compiler, spec, field):
    """The outside trial's reproducers (``guided_choice: ["<|im_end|>"]`` and kin): llguidance
    matches a grammar's special-token text to the special token, the stop token here, which
    then ended the request mid-grammar and failed the whole step. Where the grammar's start
    forces one, the compiler refuses it, naming the field."""
    with pytest.raises(HalError, match=rf"^{re.escape(field)}: expected a grammar that plain text can satisfy"):
        compiler.matcher(spec)


@pytest.mark.parametrize("k", [0, 3])
def test_a_grammar_stuck_on_a_special_token_fails_alone(model, compiler, k):
    """``ab?<eos>`` passes the compile check (its start is plain text) but, on this byte-level
    vocabulary, ``<eos>`` can only be the stop token, which the masks leave out until the
    grammar is complete: after ``a`` (and ``b``) no token is left, so that request fails alone
    with an error naming ``structured``, never emitting a special token, while a plain and a
    ``choice`` request in the same steps are what they are alone."""
    ok = Request(PROMPTS[0], max_new_tokens=12, k=k, stop_ids=(EOS,))
    fine = Request(PROMPTS[2], max_new_tokens=12, k=k, stop_ids=(EOS,),
                   structured=StructuredOutputs(choice=("<eos>", "dd")))
    solo = [SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64, grammar=compiler).generate([r])[0]
            for r in (ok, fine)]
    assert solo[1] == tokenizer().encode("dd").ids + [EOS]
    dec = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64, grammar=compiler)
    a = dec.add(ok)
    bad = dec.add(Request(PROMPTS[1], max_new_tokens=12, k=k, stop_ids=(EOS,),
                          structured=StructuredOutputs(regex="ab?<eos>")))
    c = dec.add(fine)
    got, errors = _one_step_at_a_time(dec, [a, bad, c])
    assert [got[a], got[c]] == solo and list(errors) == [bad] and errors[bad].startswith("structured: expected"), \
        (got, errors)
    assert EOS not in got[bad] and set(got[bad]) <= set(tokenizer().encode("ab").ids)
    assert dec.pool.allocator.num_free == dec.pool.allocator.num_blocks


def test_a_refused_token_fails_only_its_request(model, compiler, monkeypatch):
    """A matcher that refuses an emitted token (a mask that let it through: here the planted
    mutant that never masks special tokens) ends that request alone, without emitting the
    token; the other requests of the step are untouched (it used to raise out of the step and
    end every request in flight)."""
    from hal.engine import grammar
    from tests.mutants import mutate
    ok = Request(PROMPTS[0], max_new_tokens=12, k=3, stop_ids=(EOS,))
    alone = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64).generate([ok])[0]
    monkeypatch.setattr(grammar.Matcher, "allowed", mutate("grammar-special-tokens-unmasked").allowed)
    dec = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64, grammar=compiler)
    a = dec.add(ok)
    bad = dec.add(Request(PROMPTS[1], max_new_tokens=12, k=3, stop_ids=(EOS,),
                          structured=StructuredOutputs(regex="ab?<eos>")))
    got, errors = _one_step_at_a_time(dec, [a, bad])
    assert got[a] == alone and list(errors) == [bad], (got, errors)
    assert EOS not in got[bad] and "which it refused" in errors[bad], errors


SPECIAL_TEXT = st.lists(st.sampled_from(["<eos>", "a", "b", "x", "<", "eos", ">", "\\"]), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(pieces=st.lists(SPECIAL_TEXT, min_size=1, max_size=3), field=st.sampled_from(["choice", "regex", "json"]))
def test_fuzzed_grammars_with_special_token_text_never_hurt_another_request(model, compiler, pieces, field):
    """Grammar fields made of special-token text and plain characters: each is refused at
    compile time naming its field, or runs to a stop, or fails alone naming ``structured``;
    it never emits a special token before its end, and a plain request beside it is intact."""
    texts = ["".join(p) for p in pieces]
    spec = {"choice": lambda: StructuredOutputs(choice=tuple(texts)),
            "regex": lambda: StructuredOutputs(regex="|".join(re.escape(t) for t in texts)),
            "json": lambda: StructuredOutputs(json=json.dumps({"enum": texts}))}[field]()
    ok = Request(PROMPTS[0], max_new_tokens=10, k=3, stop_ids=(EOS,))
    dec = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64, grammar=compiler)
    a = dec.add(ok)
    try:
        bad = dec.add(Request(PROMPTS[1], max_new_tokens=10, k=3, stop_ids=(EOS,), structured=spec))
    except HalError as e:
        assert str(e).startswith(f"structured.{field}: expected"), e
        bad = None
    got, errors = _one_step_at_a_time(dec, [a] + ([bad] if bad is not None else []))
    assert got[a] == _fuzz_alone(model, ok) and a not in errors
    if bad is not None:
        assert EOS not in got[bad][:-1] and (bad not in errors or errors[bad].startswith("structured: expected"))
    assert dec.pool.allocator.num_free == dec.pool.allocator.num_blocks


_ALONE: dict = {}


def _fuzz_alone(model, req):
    if "ok" not in _ALONE:
        _ALONE["ok"] = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64).generate([req])[0]
    return _ALONE["ok"]
