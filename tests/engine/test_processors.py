"""Logits processors through the engine (`SamplingParams`: penalties, logit_bias,
allowed_token_ids, bad_words, min_tokens, min_p): greedy speculative output equals plain
greedy output with the same processors, each processor does what it says, and sampled
speculative output keeps the processed target's law (two-sample chi-square against plain
decoding, fixed seeds)."""

import pytest
import torch

import hal
from hal.drafters import NgramDrafter
from hal.engine import Request, SpeculativeDecoder
from hal.errors import HalError
from hal.models.loaders import load_safetensors
from tests.launch.test_generate import tiny  # noqa: F401  (the fixture: a tiny random model folder)

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2, 3], [9, 9, 9, 9], [11, 12, 13, 11, 12]]
PROCESSORS = {
    "penalties": dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3),
    "logit_bias": dict(logit_bias={7: 3.0, 3: -2.0}),
    "allowed": dict(allowed_token_ids=(1, 2, 3, 5, 6, 7, 9)),
    "bad_words": dict(bad_words=((5, 6), (7,), (1, 2, 3))),
    "min_tokens": dict(min_tokens=10),
    "min_p": dict(min_p=0.2, temperature=0.9),
    "all": dict(frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={4: 1.5}, bad_words=((6, 7),),
                min_tokens=6, min_p=0.1),
}


@pytest.fixture(scope="module")
def model(tiny):  # noqa: F811
    return load_safetensors(tiny, hal.get_backend("cpu"))


def run(model, k: int, n: int = 16, stop=(), **params):
    dec = SpeculativeDecoder(model, NgramDrafter(model.be) if k else None, num_blocks=128)
    outs = dec.generate([Request(p, max_new_tokens=n, k=k, stop_ids=stop, **params) for p in PROMPTS])
    return outs, dec


class Oracle:
    """Drafts the plain output itself (known in advance), so every draft is accepted when
    each verified row is processed as plain decoding would: a row that ignored the drafts
    before it (penalty counts, bad-word prefixes, the min_tokens position) would then differ."""

    def __init__(self, sequences):
        self.sequences = sequences   # prompt + plain output, per request (matched by prefix)

    def propose(self, batch):
        from hal.engine.drafting import Proposal
        ids, cu = [], [0]
        for i, k in enumerate(batch.k):
            L = int(batch.num_tokens[i])
            seen = batch.history[i, :L].tolist()
            seq = next(s for s in self.sequences if s[:L] == seen)
            d = (seq[L:L + k] + [0] * k)[:k]
            ids += d
            cu.append(cu[-1] + k)
        dev = batch.history.device
        return Proposal(draft_token_ids=torch.tensor(ids, dtype=torch.long, device=dev),
                        cu_num_draft_tokens=torch.tensor(cu, device=dev))

    def commit(self, rids, lengths):
        pass

    def release(self, rid):
        pass


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_every_draft_of_the_plain_output_is_accepted_with_processors(model, name):
    params = {**PROCESSORS[name], "temperature": 0.0}
    oracle_accepts(model, params)


def oracle_accepts(model, params, stop=(0,)):
    plain, _ = run(model, 0, stop=stop, **params)
    dec = SpeculativeDecoder(model, Oracle([p + o for p, o in zip(PROMPTS, plain)]), num_blocks=128)
    spec = dec.generate([Request(p, max_new_tokens=16, k=4, stop_ids=stop, **params) for p in PROMPTS])
    assert spec == plain
    tot = dec.metrics.total
    assert tot.num_draft_tokens > 20 and tot.num_accepted_tokens == tot.num_draft_tokens, tot
    return plain


def test_a_bad_word_whose_prefix_is_a_draft_of_the_same_step(model):
    """Ban (base[2], base[3]) of the unconstrained output: in the first decode step base[2] is a
    draft, so only a row that reads the drafts before it bans base[3] there."""
    base, _ = run(model, 0, stop=(0,))
    words = tuple((o[2], o[3]) for o in base)
    plain = oracle_accepts(model, dict(bad_words=words))
    assert plain != base


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_speculative_equals_plain_with_the_same_processors(model, name):
    params = {"temperature": 0.0, **PROCESSORS[name]}
    if name == "min_p":
        params["temperature"] = 0.0   # greedy: min_p keeps the argmax
    plain, _ = run(model, 0, stop=(0,), **params)
    spec, dec = run(model, 4, stop=(0,), **params)
    assert spec == plain
    assert dec.metrics.total.num_draft_tokens > 0, "no drafts were verified: the test would prove nothing"


def test_each_processor_changes_what_it_says(model):
    base, _ = run(model, 4)
    banned, _ = run(model, 4, bad_words=((5, 6), (7,)))
    for out, prompt in zip(banned, PROMPTS):
        seq = prompt + out
        assert 7 not in out
        assert not any(seq[i:i + 2] == [5, 6] for i in range(len(prompt) - 1, len(seq) - 1)), seq
    allowed, _ = run(model, 4, allowed_token_ids=(2, 5, 9))
    assert all(t in (2, 5, 9) for out in allowed for t in out)
    biased, _ = run(model, 4, logit_bias={42: 100.0})
    assert all(out[0] == 42 for out in biased)
    stop = tuple(sorted({out[0] for out in base}))   # every request's first greedy token is a stop
    early, _ = run(model, 4, stop=stop)
    late, _ = run(model, 4, stop=stop, min_tokens=5)
    assert all(len(out) == 1 for out in early)
    assert all(len(out) >= 5 and not set(out[:5]) & set(stop) for out in late)
    penalised, _ = run(model, 4, frequency_penalty=2.0)
    assert penalised != base
    assert max(out.count(t) for out in penalised for t in out) <= max(out.count(t) for out in base for t in out)


def test_sampled_speculative_output_keeps_the_processed_law(model):
    """The first three tokens of 1,200 seeded requests, plain against speculative: the same law
    (chi-square two-sample test, p > 1e-3; a kernel that ignores the drafts on a row's path
    fails it, see the planted mutants of the conformance suite)."""
    from scipy.stats import chi2_contingency
    params = dict(temperature=1.0, top_k=3, frequency_penalty=1.5, presence_penalty=0.5, bad_words=((5, 6),))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    def law(k):
        dec = SpeculativeDecoder(model, NgramDrafter(model.be) if k else None, num_blocks=1024, max_num_seqs=64)
        outs = dec.generate([Request(prompt, max_new_tokens=6, k=k, seed=s, **params) for s in range(1200)])
        return [tuple(o[:3]) for o in outs], dec
    plain, _ = law(0)
    spec, dec = law(3)
    assert dec.metrics.total.num_accepted_tokens > 50, "too few drafts accepted to test anything"
    keys = sorted(set(plain) | set(spec))
    table = [[plain.count(x) + 0.5 for x in keys], [spec.count(x) + 0.5 for x in keys]]
    assert chi2_contingency(table)[1] > 1e-3


@pytest.mark.parametrize("field,bad", [("frequency_penalty", 3.0), ("repetition_penalty", 0.0), ("min_p", 1.5),
                                       ("min_tokens", -1), ("logit_bias", {10 ** 6: 1.0}),
                                       ("allowed_token_ids", ()), ("bad_words", ((),))])
def test_bad_processor_parameters_are_refused_naming_the_field(model, field, bad):
    dec = SpeculativeDecoder(model, None, num_blocks=16)
    with pytest.raises(HalError, match=field):
        dec.add(Request([1, 2], **{field: bad}))
