"""hal.integrations.vllm against vLLM's own expectations.

The greedy cases and the seeded/distribution properties are transcribed as data from
vLLM's ``tests/v1/sample/test_rejection_sampler.py`` (vllm-project/vllm, commit
004fce2d0b6ad5146fa0f32b5e777dc8f5112d80): ``test_perfect_match``, ``test_early_mismatch``,
``test_multiple_sequences``, ``test_single_token_sequence``, ``test_empty_sequence``,
``test_multiple_mismatches``, ``test_parametrized_cases``, ``test_deterministic_when_seeded``
and ``test_rejection_sampling_approximates_target_distribution`` (here a chi-square); the
logits-processor cases ``test_frequency_penalties``, ``test_bad_words`` and
``test_allowed_token_ids`` (commit c64a703ec363dc7bde13dfb074b8e676a7c2219e), through the
adapter's ``sampling_metadata``; vLLM's placeholder id -1 and older vLLM's temperature -1.
vLLM is not installed or run here: its inputs and expected outputs are data, the code is ours.

Out of scope, with the reason: ``test_sample_recovered_tokens*`` compare two vLLM-internal
functions with vLLM's own random streams (spec-hal draws from Philox per (seed, offset);
`verify_rejection`'s recovery is checked by the conformance suite instead); the FLy and
synthetic rejection tests exercise vLLM's lossy verification methods, which spec-hal does not
implement (its one lossy chain method is `verify_typical`)."""

from types import SimpleNamespace

import pytest
import torch

import hal
from hal.conformance._helpers import assert_distribution
from hal.integrations.vllm import PLACEHOLDER_TOKEN_ID as P
from hal.integrations.vllm import rejection_sample

# (spec_tokens, output_tokens (the last is the bonus), expected) -- vLLM's greedy cases
GREEDY = {
    "perfect_match": ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    "early_mismatch": ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, P, P]]),
    "multiple_sequences": ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, P]]),
    "single_token_sequence": ([[1]], [[1, 2]], [[1, 2]]),
    "empty_sequence": ([[]], [[5]], [[5]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, P], [4, 8, P, P]]),
    "parametrized_perfect_with_bonus": ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
    "parametrized_first_mismatch": ([[1]], [[2, 3]], [[2, P]]),
    "parametrized_mixed": ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, P], [3, 4, 7]]),
}


def make_dummy(spec_tokens):
    """vLLM's ``SpecDecodeMetadata.make_dummy``: flat drafts, *inclusive* cu, max_spec_len."""
    n = [len(t) for t in spec_tokens]
    return SimpleNamespace(draft_token_ids=torch.tensor([t for s in spec_tokens for t in s], dtype=torch.int32),
                           cu_num_draft_tokens=torch.tensor(n).cumsum(0).int(), max_spec_len=max(n))


def logits_for(output_tokens, vocab=100):
    """vLLM's ``create_logits_tensor``: 100 at each draft position's output token, -100 elsewhere."""
    rows = [t for toks in output_tokens for t in toks[:-1]]
    logits = torch.full((len(rows), vocab), -100.0)
    logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 100.0
    return logits


@pytest.mark.parametrize("backend_name", ["cpu", "cuda", "ascend"])
@pytest.mark.parametrize("case", list(GREEDY))
def test_vllm_greedy_cases(backend_name, case):
    be = hal.get_backend(backend_name) if any(b.name == backend_name and b.available for b in hal.list_backends()) \
        else pytest.skip(f"{backend_name} unavailable here")
    spec, outs, expected = GREEDY[case]
    got = rejection_sample(make_dummy(spec), None, logits_for(outs), torch.tensor([[o[-1]] for o in outs]),
                           backend=be)
    assert got.dtype == torch.int32 and got.tolist() == expected


def test_a_layout_slip_is_caught():
    """Exclusive cu (spec-hal's own, with a leading 0) passed as vLLM's inclusive one reads as one
    request too many: refused, naming the argument that disagrees."""
    spec, outs, _ = GREEDY["multiple_sequences"]
    md = make_dummy(spec)
    md.cu_num_draft_tokens = torch.tensor([0, 2, 3])
    with pytest.raises(hal.HalError) as e:
        rejection_sample(md, None, logits_for(outs), torch.tensor([[5], [4]]), backend=hal.get_backend("cpu"))
    assert e.value.arg in ("bonus_token_ids", "metadata.cu_num_draft_tokens")


@pytest.mark.parametrize("old,new", [
    ("cu = torch.cat([incl.new_zeros(1), incl])", "cu = torch.cat([incl, incl[-1:]])"),   # cu read as exclusive
    ("last_rows = cu[1:] + req", "last_rows = cu[:-1] + req"),                          # bonus row misplaced
])
def test_planted_layout_slips_fail_vllms_cases(old, new, tmp_path):
    import importlib.util
    src = open(importlib.util.find_spec("hal.integrations.vllm").origin).read()
    assert src.count(old) == 1
    path = tmp_path / "planted_vllm.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location("planted_vllm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    wrong = 0
    for spec_tokens, outs, expected in GREEDY.values():
        try:
            got = mod.rejection_sample(make_dummy(spec_tokens), None, logits_for(outs),
                                       torch.tensor([[o[-1]] for o in outs]), backend=hal.get_backend("cpu"))
            wrong += got.tolist() != expected
        except (hal.HalError, RuntimeError, IndexError):
            wrong += 1
    assert wrong >= 3, f"the planted slip passed {len(GREEDY) - wrong} of {len(GREEDY)} of vLLM's cases"


def test_vllm_deterministic_when_seeded():
    g = torch.Generator().manual_seed(0)
    B, k, V = 8, 3, 1000
    draft_probs = torch.softmax(torch.rand(B * k, V, generator=g), -1)
    logits = torch.rand(B * k, V, generator=g)
    drafts = torch.randint(0, V, (B, k), generator=g)
    bonus = torch.randint(0, V, (B, 1), generator=g)
    md = make_dummy(drafts.tolist())
    seeds = torch.arange(B)
    runs = [rejection_sample(md, draft_probs, logits, bonus, temperature=torch.ones(B), seeds=seeds,
                             backend=hal.get_backend("cpu")) for _ in range(5)]
    assert all(torch.equal(r, runs[0]) for r in runs)


def test_vllm_rejection_sampling_matches_the_target_distribution():
    """vLLM's distribution test (V=10, k=2, draft and target random), as a chi-square at
    alpha 1e-6 on 100,000 samples of the first emitted token."""
    g = torch.Generator().manual_seed(1)
    V, k, n = 10, 2, 100_000
    q = torch.softmax(torch.rand(V, generator=g), -1)
    target_logits = torch.rand(V, generator=g)
    p = torch.softmax(target_logits, -1)
    drafts = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
    bonus = torch.multinomial(p, n, replacement=True, generator=g).view(n, 1)
    out = rejection_sample(make_dummy(drafts.tolist()), q.repeat(n * k, 1), target_logits.repeat(n * k, 1), bonus,
                           temperature=torch.ones(n), seeds=torch.arange(n), backend=hal.get_backend("cpu"))
    assert_distribution(out[:, 0], p, "first emitted token")


def test_top_k_top_p_filter_the_target():
    """vLLM applies top-k/top-p to the target logits before verifying: with top_k = 3 and
    temperature 0.7 the first emitted token follows softmax(logits / 0.7) over the top 3 only."""
    g = torch.Generator().manual_seed(4)
    V, n = 8, 60_000
    q = torch.softmax(torch.rand(V, generator=g), -1)
    target_logits = torch.rand(V, generator=g) * 3
    top3 = target_logits.topk(3).indices
    p = torch.zeros(V)
    p[top3] = torch.softmax(target_logits[top3] / 0.7, -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    out = rejection_sample(make_dummy(drafts.tolist()), q.repeat(n, 1), target_logits.repeat(n, 1),
                           torch.zeros(n, 1, dtype=torch.long), temperature=torch.full((n,), 0.7),
                           top_k=torch.full((n,), 3), top_p=torch.ones(n), seeds=torch.arange(n),
                           backend=hal.get_backend("cpu"))
    assert_distribution(out[:, 0], p, "first emitted token under top-k 3")


def test_mixed_greedy_and_random_requests():
    """Per-request temperature: greedy rows behave exactly as vLLM's greedy path, random rows
    keep the target law, in one batch."""
    g = torch.Generator().manual_seed(2)
    V, n = 6, 40_000
    p_logits = torch.rand(V, generator=g) * 2
    p = torch.softmax(p_logits, -1)
    q = torch.softmax(torch.rand(V, generator=g), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    temp = torch.tensor([0.0, 1.0]).repeat(n // 2)
    bonus = torch.full((n, 1), 3)
    out = rejection_sample(make_dummy(drafts.tolist()), q.repeat(n, 1), p_logits.repeat(n, 1), bonus,
                           temperature=temp, seeds=torch.arange(n), backend=hal.get_backend("cpu"))
    top = int(p_logits.argmax())
    greedy, rnd = out[0::2], out[1::2]
    d = drafts[0::2, 0]
    want = torch.where(d == top, torch.tensor(3), torch.tensor(top))     # accepted -> bonus, else the argmax
    assert torch.equal(greedy[:, 0], torch.where(d == top, d, torch.tensor(top)).int())
    assert torch.equal(greedy[:, 1], torch.where(d == top, want, torch.tensor(P)).int())
    assert_distribution(rnd[:, 0], p, "random rows in a mixed batch")


# vLLM's tests/v1/spec_decode/test_ngram.py (vllm-project/vllm, commit 016e8ede870e3c087fdcdfb36ed3622112712f10):
# (context, min_n, max_n, k, expected drafts or None)
NGRAM = [
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, None),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),                       # the first match
    ([1, 2, 3, 4, 5], 2, 2, 2, None),                                     # no match
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, None),                               # no 4-gram
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),                             # a 3-gram
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),              # the 4-gram wins, not [5, 1]
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),                    # the 3-gram, not [5, 2]
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),   # the first 3-gram
]


@pytest.mark.parametrize("backend_name", ["cpu", "cuda", "ascend"])
def test_vllm_ngram_cases(backend_name):
    import numpy as np

    from hal.integrations.vllm import NgramProposer
    if not any(b.name == backend_name and b.available for b in hal.list_backends()):
        pytest.skip(f"{backend_name} unavailable here")
    be = hal.get_backend(backend_name)
    for ctx, lo, hi, k, want in NGRAM:
        got = NgramProposer(lo, hi, k, max_model_len=1024, backend=be).propose(np.array(ctx))
        assert (got is None and want is None) or (got is not None and got.tolist() == want), (ctx, lo, hi, k, got)
    batch = NgramProposer(1, 4, 3, backend=be).propose_batch([c for c, *_ in NGRAM])
    assert len(batch) == len(NGRAM)
    assert NgramProposer(1, 1, 3, max_model_len=8, backend=be).propose(np.array(NGRAM[1][0])).tolist() == [4]


# vLLM's logits-processor cases of the same file (vllm-project/vllm, commit
# c64a703ec363dc7bde13dfb074b8e676a7c2219e): test_frequency_penalties, test_bad_words and
# test_allowed_token_ids. Each row's penalty counts the drafts before it (vLLM's
# apply_logits_processors); token 15 is the runner-up (logit 99) in every row.
def override_15(output_tokens):
    logits = logits_for(output_tokens)
    logits[:, 15] = 99.0
    return logits


def sampling_metadata(**fields):
    base = dict(temperature=None, top_k=None, top_p=None, no_penalties=True, output_token_ids=None,
                prompt_token_ids=None, frequency_penalties=None, presence_penalties=None, repetition_penalties=None,
                allowed_token_ids_mask=None, bad_words_token_ids={})
    return SimpleNamespace(**{**base, **fields})


def allowed_mask(batch_size, vocab_size, num_allowed):
    """vLLM's ``create_allowed_token_ids``: even requests mask ids [i, i + num_allowed) (True: not allowed)."""
    mask = torch.zeros(batch_size, vocab_size, dtype=torch.bool)
    for i in range(0, batch_size, 2):
        mask[i, min(i, vocab_size - 1):min(i + num_allowed, vocab_size - 1)] = True
    return mask


PROCESSOR_CASES = {
    "frequency_penalties": ([[1, 1, 1], [], [1, 1, 1]], [[1, 1, 1, 1], [7], [1, 1, 1, 1]],
                            dict(no_penalties=False, output_token_ids=[[2], [3], [4]],
                                 prompt_token_ids=torch.tensor([[5, 6, 7], [6, 7, 8], [7, 8, 9]]),
                                 frequency_penalties=torch.tensor([1.5, 1.5, 0.7]),
                                 presence_penalties=torch.zeros(3), repetition_penalties=torch.ones(3)),
                            [[1, 15, P, P], [7, P, P, P], [1, 1, 15, P]]),
    "bad_words": ([[1, 2, 3], [1, 15, 3], [1, 2, 3]], [[1, 2, 3, 4], [1, 15, 3, 4], [1, 2, 3, 4]],
                  dict(output_token_ids=[[2], [3], [4]], bad_words_token_ids={0: [[2]], 2: [[2]]}),
                  [[1, 15, P, P], [1, 15, 3, 4], [1, 15, P, P]]),
    "allowed_token_ids": ([[1, 2, 10], [10, 5, 3], [7, 10, 12]], [[1, 2, 10, 5], [10, 5, 10, 5], [7, 10, 12, 5]],
                          dict(output_token_ids=[[], [], []], allowed_token_ids_mask=allowed_mask(3, 100, 5)),
                          [[15, P, P, P], [10, 5, 10, P], [7, 10, 12, 5]]),
}


@pytest.mark.parametrize("backend_name", ["cpu", "cuda", "ascend"])
@pytest.mark.parametrize("case", list(PROCESSOR_CASES))
def test_vllm_logits_processor_cases(backend_name, case):
    if not any(b.name == backend_name and b.available for b in hal.list_backends()):
        pytest.skip(f"{backend_name} unavailable here")
    spec, outs, fields, expected = PROCESSOR_CASES[case]
    got = rejection_sample(make_dummy(spec), None, override_15(outs), torch.tensor([[o[-1]] for o in outs]),
                           backend=hal.get_backend(backend_name), sampling_metadata=sampling_metadata(**fields))
    assert got.tolist() == expected


def test_placeholder_drafts_are_rejected_cleanly():
    """vLLM pads a request's unused draft slots with -1: a draft -1 is never accepted; the
    request emits the target's token at that position (here its argmax), as a mismatch would."""
    md = make_dummy([[1, 2, P], [3, P, P]])
    logits = logits_for([[1, 2, 9, 4], [3, 8, 8, 5]])
    got = rejection_sample(md, None, logits, torch.tensor([[4], [5]]), backend=hal.get_backend("cpu"))
    assert got.tolist() == [[1, 2, 9, P], [3, 8, P, P]]
    with pytest.raises(hal.HalError, match="draft_token_ids"):
        rejection_sample(make_dummy([[1, -7]]), None, logits_for([[1, 2, 3]]), torch.tensor([[3]]),
                         backend=hal.get_backend("cpu"))


def test_temperature_minus_one_is_greedy():
    """Older vLLM marks greedy requests with temperature -1."""
    spec, outs, expected = GREEDY["multiple_mismatches"]
    got = rejection_sample(make_dummy(spec), None, logits_for(outs), torch.tensor([[o[-1]] for o in outs]),
                           temperature=torch.tensor([-1.0, -1.0]), backend=hal.get_backend("cpu"))
    assert got.tolist() == expected
    with pytest.raises(hal.HalError, match="temperature"):
        rejection_sample(make_dummy(spec), None, logits_for(outs), torch.tensor([[o[-1]] for o in outs]),
                         temperature=torch.tensor([-0.5, 1.0]), backend=hal.get_backend("cpu"))
