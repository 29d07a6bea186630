"""DSpark block drafting: the drafter's paged path equals the training module (from scratch and
after its context cache has grown), sampled drafts return exactly the rows they were drawn
from, greedy output with the drafter equals plain greedy, and the confidence cut is
non-anticipating."""

from __future__ import annotations

import pytest
import torch
from dataclasses import replace

from hypothesis import given, settings, strategies as st

from hal.drafters.dspark import DSparkDrafter, confidence_cut
from hal.engine import SpeculativeDecoder
from hal.engine.drafting import DraftBatch
from hal.engine.requests import Request
from hal.engine.costs import CostModel
from hal.errors import HalError
from hal.models.block_layouts import load_block, write_block
from hal.models.dspark import DSparkConfig, DSparkModel
from hal.models.llama import random_llama
from hal.training.dspark_train import DSparkTrain
from tests.drafters.test_eagle import D, FFN, H, HEADS, KV, LAYERS, V, target_features

TAPS = (1, 4, 6)
DRAFT = torch.tensor(sorted(set(range(0, V, 2)) | {1, 3, 5}))
MASK = 5   # the mask rows are this token's embedding


@pytest.fixture(scope="module")
def target():
    return random_llama(H, LAYERS, HEADS, KV, D, FFN, V, seed=7, scale=0.15)


def config(block=4, layers=2, anchor_predicts=True) -> DSparkConfig:
    """DeepSpec's DSpark (the anchor's row proposes too: B proposals), or with ``anchor_predicts``
    False z-lab's DFlash rows (B - 1) under the same heads."""
    return DSparkConfig(hidden=H, heads=HEADS, kv_heads=KV, head_dim=D, ffn=FFN, layers=layers, taps=TAPS, block=block,
                       rank=4, draft_vocab=len(DRAFT), anchor_predicts=anchor_predicts)


def trained(target, seed=0, **kw) -> DSparkTrain:
    m = DSparkTrain(config(**kw), target.embed, target.head, DRAFT, MASK, seed)
    with torch.no_grad():   # non-trivial norms, Markov and confidence weights
        for name, p in m.p.items():
            if name.endswith("norm") or name in ("markov_w1", "markov_out", "conf", "conf_bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return m


def view(ids, L, feats, k, rid=0, temperature=0.0, costs=None):
    return DraftBatch(rids=(rid,), params=(Request(ids[:L], k=k, temperature=temperature, seed=3),),
                      history=torch.tensor([ids]), num_tokens=torch.tensor([L]), lengths=(L,), k=(k,), offsets=(0,),
                      features=feats, num_features=(len(feats),), costs=costs)


def train_rows(train, f, ids, anchor, prev):
    """The training module's final rows [len(prev), Vd] at ``anchor`` with the Markov head fed
    ``prev``, their hidden states, and their confidences."""
    with torch.no_grad():
        base, h = train(f[None], torch.tensor(ids)[None], torch.tensor([[anchor]]))
        n, prev = len(prev), torch.tensor(prev)
        return base[0, 0, :n] + train.markov(prev), h[0, 0, :n], torch.sigmoid(train.confidence(h[0, 0, :n], prev))


@pytest.mark.parametrize("anchor_predicts", [True, False])
def test_the_drafter_equals_the_training_module_from_scratch_and_incrementally(target, anchor_predicts):
    """Both row layouts; a call that passes no new features drafts from the kept ones."""
    train = trained(target, anchor_predicts=anchor_predicts)
    model = DSparkModel(train.cfg, train.weights(), target)
    drafter = DSparkDrafter(model)
    ids = [(7 * i + 3) % V for i in range(30)]
    f = target_features(target, ids, TAPS)
    for L, new, k in ((12, slice(0, 11), 3), (17, slice(11, 16), 3), (17, slice(16, 16), 3), (20, slice(16, 19), 0),
                      (25, slice(19, 24), 3)):
        p = drafter.propose(view(ids, L, f[new], k=k))
        if k == 0:   # routed to k = 0: no forward; the features are held for the next block
            assert p.draft_token_ids.numel() == 0 and drafter.draft_kv.valid_len(0) == 16
            assert sum(len(x) for x in drafter.held[0]) == 3
            continue
        drafts = p.draft_token_ids.tolist()
        rows, h, conf = train_rows(train, f, ids, L - 1, [ids[L - 1]] + drafts[:-1])
        assert drafts == DRAFT[rows.argmax(-1)].tolist()          # Markov-chained greedy, left to right
        torch.testing.assert_close(torch.tensor(drafter.confidences[0]), conf[:3], atol=1e-5, rtol=1e-5)
        assert p.num_valid.tolist() == [3]


def test_held_features_past_the_bound_are_written_and_drafts_do_not_change(target, monkeypatch):
    """Steps routed to k = 0 hold their features (no forward) until `HOLD` rows, then write them;
    either way the next block equals the training module's, and a release drops what is held."""
    import hal.drafters.dspark as dspark
    monkeypatch.setattr(dspark, "HOLD", 4)
    train = trained(target)
    drafter = DSparkDrafter(DSparkModel(train.cfg, train.weights(), target))
    ids = [(11 * i + 5) % V for i in range(30)]
    f = target_features(target, ids, TAPS)
    drafter.propose(view(ids, 8, f[:7], k=3))
    drafter.propose(view(ids, 11, f[7:10], k=0))
    assert drafter.draft_kv.valid_len(0) == 7 and len(drafter.held[0]) == 1    # 3 rows held
    drafter.propose(view(ids, 13, f[10:12], k=0))                             # 5 > HOLD: all written
    assert drafter.draft_kv.valid_len(0) == 12 and 0 not in drafter.held
    drafter.propose(view(ids, 15, f[12:14], k=0))
    drafter.propose(view(ids, 16, f[14:15], k=0))
    assert len(drafter.held[0]) == 2
    p = drafter.propose(view(ids, 18, f[15:17], k=3))
    rows, h, conf = train_rows(train, f, ids, 17, [ids[17]] + p.draft_token_ids.tolist()[:-1])
    assert p.draft_token_ids.tolist() == DRAFT[rows.argmax(-1)].tolist()
    torch.testing.assert_close(torch.tensor(drafter.confidences[0]), conf[:3], atol=1e-5, rtol=1e-5)
    drafter.propose(view(ids, 20, f[17:19], k=0))
    drafter.release(0)
    assert 0 not in drafter.held and drafter.draft_kv.valid_len(0) == 0


def test_sampled_drafts_carry_exactly_the_rows_they_were_drawn_from(target):
    train = trained(target, seed=1)
    drafter = DSparkDrafter(DSparkModel(train.cfg, train.weights(), target))
    ids = [(5 * i + 1) % V for i in range(20)]
    f = target_features(target, ids, TAPS)
    p = drafter.propose(view(ids, 14, f[:13], k=6, temperature=0.7))   # k > B: filler after 4
    assert p.num_valid.tolist() == [4] and p.draft_probs.shape == (6, V)
    drafts = p.draft_token_ids[:4].tolist()
    rows, _, _ = train_rows(train, f, ids, 13, [ids[13]] + drafts[:3])
    full = torch.full((4, V), float("-inf"))
    full[:, DRAFT] = rows
    torch.testing.assert_close(p.draft_probs[:4], torch.softmax(full / 0.7, -1), atol=1e-5, rtol=1e-4)
    assert all(p.draft_probs[j, t] > 0 for j, t in enumerate(drafts))


def lossless(target, drafter, prompts, k=3, **kw):
    plain = SpeculativeDecoder(target, None).generate([Request(p, max_new_tokens=20, k=0) for p in prompts])
    dec = SpeculativeDecoder(target, drafter, **kw)
    assert dec.generate([Request(p, max_new_tokens=20, k=k) for p in prompts]) == plain
    return dec


PROMPTS = [[3, 17, 17, 40, 2, 9], [50, 51, 52], list(range(1, 40, 3)), [7]]


def test_greedy_output_with_the_block_drafter_equals_plain_greedy(target):
    model = DSparkModel(trained(target).cfg, trained(target).weights(), target)
    dec = lossless(target, DSparkDrafter(model), PROMPTS, max_num_batched_tokens=16, max_num_seqs=4)
    assert dec.metrics.total.num_draft_tokens > 0
    lossless(target, DSparkDrafter(model), PROMPTS, k=6, num_blocks=7, max_num_seqs=4)   # preemption; k > B
    small = DSparkDrafter(model, num_blocks=2)
    lossless(target, small, PROMPTS)
    assert small.lost > 0                      # a full context cache means no drafts, not wrong ones
    from hal.drafters import NgramDrafter
    from hal.drafters.eagle import NgramOrHead
    both = lossless(target, NgramOrHead(NgramDrafter(target.be, min_n=2), DSparkDrafter(model)),
                    PROMPTS + [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    assert both.metrics.total.num_draft_tokens > 0
    from hal.launch.build import build_engine
    cut = DSparkDrafter(model)
    routed = build_engine(target, cut, k=3, route=True, costs=COSTS)
    plain = SpeculativeDecoder(target, None).generate([Request(p, max_new_tokens=20, k=0) for p in PROMPTS])
    assert routed.generate([Request(p, max_new_tokens=20, k=3) for p in PROMPTS]) == plain   # router + cut
    runs = [SpeculativeDecoder(target, DSparkDrafter(model)).generate(
        [Request(p, max_new_tokens=16, k=3, temperature=0.8, seed=5) for p in PROMPTS]) for _ in range(2)]
    assert runs[0] == runs[1] and all(len(r) == 16 for r in runs[0])


def test_a_written_block_drafter_loads_and_bad_ones_are_refused(target, tmp_path):
    train = trained(target)
    write_block(tmp_path / "b", train.cfg, train.weights(), MASK, LAYERS, (target.embed, target.head), vocab=V)
    model = load_block(tmp_path / "b", target)
    assert model.cfg == replace(train.cfg, eps=model.cfg.eps) and torch.equal(model.draft_ids, DRAFT)
    w = train.weights()
    with pytest.raises(HalError, match="weight 0.wqkv: expected shape"):
        DSparkModel(train.cfg, {**w, "0.wqkv": w["0.wqkv"][:-1]}, target)
    for bad in ((1, 1, 6), (1, 6, 4), (1, 4, LAYERS + 1)):
        with pytest.raises(HalError, match="taps: expected increasing layers"):
            DSparkModel(DSparkConfig(**{**train.cfg.__dict__, "taps": bad}), w, target)
    DSparkModel(DSparkConfig(**{**train.cfg.__dict__, "taps": (1, 4, LAYERS)}), w, target)   # the last layer's output
    with pytest.raises(HalError, match="draft_ids: expected"):
        DSparkModel(train.cfg, {**w, "draft_ids": w["draft_ids"] + V}, target)
    with pytest.raises(HalError, match="config.json, got no such file"):
        load_block(tmp_path / "none", target)


COSTS = CostModel({1: 0.010, 2: 0.0105, 4: 0.011, 8: 0.013, 9: 0.019, 16: 0.022, 32: 0.04})


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.floats(0.01, 0.99), min_size=7, max_size=7), min_size=1, max_size=4),
       st.integers(0, 3), st.integers(0, 6), st.lists(st.floats(0.01, 0.99), min_size=7, max_size=7))
def test_the_confidence_cut_never_looks_at_a_position_or_later(conf, i, j, other):
    """Whether request i verifies position j depends on its confidences up to j (and other
    requests'), never on those after j: they depend on the token drawn at j."""
    i = i % len(conf)
    caps, ctx = (7,) * len(conf), [40] * len(conf)
    before = confidence_cut(conf, caps, ctx, COSTS)
    changed = [row[:] for row in conf]
    changed[i][j + 1:] = other[j + 1:]
    after = confidence_cut(changed, caps, ctx, COSTS)
    assert min(before[i], j + 1) == min(after[i], j + 1)
    assert all(0 <= t <= 7 for t in before)


def test_the_confidence_cut_verifies_what_pays():
    sure, unsure = [0.99] * 7, [0.03] * 7
    assert confidence_cut([sure], (7,), [10], COSTS) == [7]       # the step stays below a chunk width
    assert confidence_cut([unsure], (7,), [10], COSTS) == [0]
    assert confidence_cut([sure, unsure], (7, 7), [10, 10], COSTS) == [7, 0]
    assert confidence_cut([sure], (3,), [10], COSTS) == [3]       # never past the cap


def test_the_block_drafter_on_the_draft_rank_gets_the_features_over_the_link(target):
    """The block drafter in the draft worker (in-process link): the taps' features cross once, so
    its drafts and acceptance are exactly those of the same drafter in-process; greedy == plain."""
    import queue
    import threading

    from hal.distributed.remote import RemoteDrafter
    from hal.distributed.worker import draft_worker
    from hal.metrics import SpecDecodeMetrics
    from tests.launch.test_generate import QueueLink
    train = trained(target, seed=2)
    model = DSparkModel(train.cfg, train.weights(), target)
    local = lossless(target, DSparkDrafter(model), PROMPTS)
    a, b = queue.Queue(), queue.Queue()
    worker = threading.Thread(target=draft_worker, daemon=True, args=(QueueLink(a, b), DSparkDrafter(model)))
    worker.start()
    metrics = SpecDecodeMetrics()
    remote = RemoteDrafter(QueueLink(b, a), V, torch.device("cpu"), metrics, timeout=30, features=TAPS)
    lossless(target, remote, PROMPTS, metrics=metrics)
    remote.close()
    worker.join(timeout=30)
    assert metrics.draft_failures == 0
    assert metrics.total.accepted_per_position == local.metrics.total.accepted_per_position
    assert metrics.total.num_draft_tokens == local.metrics.total.num_draft_tokens > 0


def best_prefix_cut(conf, caps, contexts, costs):
    """A planted mutant: the router's rule (the best prefix of the whole ranked path), which
    reads every confidence before deciding any position."""
    R = len(caps)
    P = [[float(torch.tensor(conf[i][:j + 1]).prod()) for j in range(caps[i])] for i in range(R)]
    order = sorted((-p, j, i) for i in range(R) for j, p in enumerate(P[i]))
    fed, attn, tokens = R, sum(contexts), float(R)
    best, best_at, path = tokens / costs.cost(fed, attn, 0), 0, []
    for neg, j, i in order:
        fed, attn, tokens = fed + 1, attn + contexts[i], tokens - neg
        path.append(i)
        if tokens / costs.cost(fed, attn, 0) > best:
            best, best_at = tokens / costs.cost(fed, attn, 0), len(path)
    return [path[:best_at].count(i) for i in range(R)]


def test_the_best_prefix_rule_would_anticipate_and_the_cut_does_not():
    """Position 0 alone does not pay at P = 0.045 (cost(2) is 5% over cost(1)); with three more at
    about that P it does (cost(4) is 10% over). The cut decides position 0 from its own P; the
    mutant takes it only when the later confidences, drawn after it, are high."""
    high, low = [[0.045] + [0.99] * 6], [[0.045] + [0.01] * 6]
    assert min(best_prefix_cut(high, (7,), [10], COSTS)[0], 1) != min(best_prefix_cut(low, (7,), [10], COSTS)[0], 1)
    assert min(confidence_cut(high, (7,), [10], COSTS)[0], 1) == min(confidence_cut(low, (7,), [10], COSTS)[0], 1)


@pytest.fixture(scope="module")
def distilled(target):
    """A block drafter self-distilled on this target's own greedy continuations (200 steps), so
    its sampled drafts are accepted often enough to test the law."""
    from hal.training.block_data import CANDIDATE_TAPS
    from hal.training.dspark_train import train_block
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (4,), generator=g).tolist() for _ in range(48)]
    outs = SpeculativeDecoder(target, None).generate([Request(p, max_new_tokens=28, k=0) for p in prompts])
    seqs = [p + o for p, o in zip(prompts, outs)]
    feats = []
    for s in seqs:
        f = torch.zeros(len(s), len(CANDIDATE_TAPS), H)
        f[:, :2] = target_features(target, s, CANDIDATE_TAPS[:2]).view(len(s), 2, H)
        feats.append(f.half())
    cfg = DSparkConfig(hidden=H, heads=HEADS, kv_heads=KV, head_dim=D, ffn=FFN, layers=1, taps=CANDIDATE_TAPS[:2],
                      block=4, rank=8, draft_vocab=V)
    blob = {"ids": seqs, "prompt_lens": [4] * len(seqs), "texts": ["x"] * len(seqs)}
    got = train_block(cfg, blob, feats, target, 10.0, batch=8, anchors=8, lr=3e-3, max_steps=200, say=lambda _: None)
    return DSparkModel(cfg, got["weights"], target)


class WrongRow(DSparkDrafter):
    """A planted mutant: each position reports a q that is not the row it was drawn from: the
    first a uniform row over the draft vocabulary (as if neither its base row nor its Markov
    bias applied), the later ones the row of the position before (the Markov head fed the wrong
    previous token)."""

    def propose(self, batch):
        p = super().propose(batch)
        if p.draft_probs is None:
            return p
        q = p.draft_probs.clone()
        cu = p.cu_num_draft_tokens.tolist()
        for i in range(len(batch.rids)):
            if cu[i + 1] - cu[i] > 1:
                q[cu[i] + 1:cu[i + 1]] = p.draft_probs[cu[i]:cu[i + 1] - 1]
            if cu[i + 1] > cu[i]:   # the first: as if drawn without its Markov row, uniformly over the draft vocabulary
                q[cu[i]] = torch.zeros(V).index_fill_(0, DRAFT, 1.0 / len(DRAFT))
        return replace(p, draft_probs=q)


def law(target, drafter, prompt, n=900, temperature=2.5):
    """The first three sampled tokens of ``n`` seeds (temperature 2.5: this random target is peaked)."""
    dec = SpeculativeDecoder(target, drafter, num_blocks=1024, max_num_seqs=64)
    outs = dec.generate([Request(prompt, max_new_tokens=4, k=0 if drafter is None else 3, seed=s,
                                 temperature=temperature) for s in range(n)])
    return [tuple(o[:3]) for o in outs], dec


def test_sampled_output_keeps_the_target_law_and_a_wrong_row_mutant_does_not(target, distilled):
    from scipy.stats import chi2_contingency
    prompt = [5, 17, 30, 2]
    plain, _ = law(target, None, prompt)
    spec, dec = law(target, DSparkDrafter(distilled), prompt)
    mutant, _ = law(target, WrongRow(distilled), prompt)
    assert dec.metrics.total.num_accepted_tokens > 150, "too few drafts accepted to test anything"

    def p_value(a, b, at):   # the law of the token at index ``at`` (cells under 5 expected pooled)
        a, b = [t[at] for t in a], [t[at] for t in b]
        keys = sorted(set(a) | set(b), key=lambda x: -(a.count(x) + b.count(x)))
        big = [x for x in keys if a.count(x) + b.count(x) >= 10]
        rows = [[a.count(x) for x in big] + [sum(a.count(x) for x in keys if x not in big)],
                [b.count(x) for x in big] + [sum(b.count(x) for x in keys if x not in big)]]
        return chi2_contingency([[c + 0.5 for c in r] for r in rows])[1]
    assert p_value(plain, spec, 1) > 1e-3 and p_value(plain, spec, 2) > 1e-3   # index 0 comes from the prefill
    assert p_value(plain, mutant, 1) < 1e-6


def test_the_shipped_block_drafter_is_checked_and_named():
    from hal.models.block_layouts import read_config
    from hal.models.dspark import shipped_block
    path = shipped_block("smollm2-135m")
    cfg = read_config(path)
    assert (cfg.hidden, cfg.taps, cfg.block, cfg.layers, cfg.anchor_predicts) == (576, (1, 16, 29), 7, 1, True)
    with pytest.raises(HalError, match="shipped block drafter"):
        shipped_block("other-model")


@pytest.mark.parametrize("bad", ["1,1", "16,1", "3", "x", ""])
def test_bad_taps_are_refused_by_the_cli(bad):
    import argparse

    from hal.training.command import taps_flag
    with pytest.raises(argparse.ArgumentTypeError, match="expected"):
        taps_flag(bad)
    assert taps_flag("1,16,29") == (1, 16, 29) and taps_flag("1,16,30") == (1, 16, 30)


def test_the_block_drafter_runs_its_linears_through_the_targets_plan(target):
    """As the EAGLE head: a batch-invariant target's plan runs every linear of the block
    drafter (fc, each layer's, the lm_head rows) in chunks of its widths, and its greedy
    drafts stay those of the training module."""
    from hal.models.linear_layout import LinearPlan
    from hal.models.llama import Llama
    calls = []

    def layout(x, w):
        calls.append((x.shape[0], tuple(w.shape)))
        return torch.mm(w, x.T).T

    plan = LinearPlan("mm", torch.float32, (1, 8), fn=layout)
    planned = Llama(target.cfg, dict(target.w), target.be, plan=plan)
    train = trained(target)
    drafter = DSparkDrafter(DSparkModel(train.cfg, train.weights(), planned))
    assert drafter.model.linears == f"the target's plan: {plan.describe()}"
    ids = [(7 * i + 3) % V for i in range(30)]
    f = target_features(target, ids, TAPS)
    p = drafter.propose(view(ids, 12, f[:11], k=3))
    rows, _, _ = train_rows(train, f, ids, 11, [ids[11]] + p.draft_token_ids.tolist()[:-1])
    assert p.draft_token_ids.tolist() == DRAFT[rows.argmax(-1)].tolist()
    shapes = {s for _, s in calls}
    assert (len(DRAFT), H) in shapes and (H, len(TAPS) * H) in shapes and len(shapes) >= 5
    assert {m for m, _ in calls} <= {1, 8}
