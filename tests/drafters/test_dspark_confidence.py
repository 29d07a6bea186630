"""Refitting a DSpark drafter's confidence head on held-back sequences (`hal.training.confidence`,
`hal.training.command.refit_folder`): the fit is the regularised logistic regression's minimum, the
refit reads the validation split only and every proposed position of it, it mends an
overconfident head, and a folder it cannot refit is refused before any work."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hal.errors import HalError
from hal.models.block_layouts import write_block
from hal.models.dspark import Confidence, DSparkConfig
from hal.models.llama import random_llama
from hal.training.block_data import CANDIDATE_TAPS, to_draft_of
from hal.training.block_data import BlockData
from hal.training.dspark_train import DSparkTrain
from hal.training.command import refit_folder
from hal.training.confidence import bce, fit, refit, samples
from tests.drafters.test_eagle import D, FFN, H, HEADS, KV, LAYERS, V, target_features

B = 4


@pytest.fixture(scope="module")
def target():
    return random_llama(H, LAYERS, HEADS, KV, D, FFN, V, seed=7, scale=0.15)


@pytest.fixture(scope="module")
def data(target):
    """40 sequences in the data cache's layout (the target fills the first two candidate taps)
    and a DSpark drafter of random weights for them (over a draft vocabulary: a token map)."""
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, V, (14 + i % 5,), generator=g).tolist() for i in range(40)]
    feats = []
    for s in seqs:
        f = torch.zeros(len(s), len(CANDIDATE_TAPS), H)
        f[:, :2] = target_features(target, s, CANDIDATE_TAPS[:2]).view(len(s), 2, H)
        feats.append(f.half())
    blob = {"ids": seqs, "prompt_lens": [6] * len(seqs), "texts": ["x"] * len(seqs)}
    cfg = DSparkConfig(hidden=H, heads=HEADS, kv_heads=KV, head_dim=D, ffn=FFN, layers=1, taps=CANDIDATE_TAPS[:2],
                      block=B, rank=4, draft_vocab=V - 8)
    d = BlockData(blob, feats, [0, 1], cfg.draft_vocab, target.cfg.stop_ids, seed=0)
    return blob, feats, cfg, d


def model_for(target, cfg, d, conf_bias=0.0):
    m = DSparkTrain(cfg, target.embed, target.head, d.draft_ids, 0, seed=1)
    with torch.no_grad():
        m.w("conf_bias").fill_(conf_bias)
    return m


def test_the_fit_is_the_minimum_of_the_regularised_logistic_loss():
    """On data drawn from a known logistic law (fixed seed) the fit recovers its weights (0.15)
    and its gradient is zero (1e-6); a larger L2 shrinks the weights, never the bias."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, 3, generator=g, dtype=torch.float64)
    truth = torch.tensor([1.5, -2.0, 0.5, -0.7], dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(x @ truth[:-1] + truth[-1]), generator=g)
    w = fit(x, y, 1e-6)
    assert (w - truth).abs().max() < 0.15, w
    w.requires_grad_(True)
    loss = F.binary_cross_entropy_with_logits(x @ w[:-1] + w[-1], y) + 1e-6 * (w[:-1] ** 2).sum()
    loss.backward()
    assert w.grad.abs().max() < 1e-6
    strong = fit(x, y, 1.0)
    assert strong[:-1].norm() < 0.5 * truth[:-1].norm()
    assert bce(x, y, w.detach()) < bce(x, y, strong)


def test_refit_reads_every_proposed_position_of_the_held_back_sequences_only(target, data):
    """The samples are the proposals of a block at every response position of each validation
    sequence that lands inside it (counted here independently); changing every training
    sequence changes no bit of the refitted head."""
    blob, feats, cfg, d = data
    m = model_for(target, cfg, d)
    to_draft = to_draft_of(d.draft_ids, V)
    want = 0
    for i in d.val:
        n, start = len(d.ids[i]), int(d.starts[i])
        want += sum(1 for a in range(start, n - 1) for j in range(1, B + 1) if a + j < n)
    x, y = samples(m, d, d.val, to_draft)
    assert x.shape == (want, H + cfg.rank) and y.shape == (want,)   # [h, markov_w1[prev]]
    conf, bias, report = refit(m, d, to_draft)
    assert report["positions"] == want and report["sequences"] == len(d.val)
    assert report["bce_out_of_fold"] == min(report["bce_by_choice"].values())
    other = BlockData({**blob, "ids": [list(s) for s in blob["ids"]]}, feats, [0, 1], cfg.draft_vocab,
                      target.cfg.stop_ids, seed=0)
    g = torch.Generator().manual_seed(9)
    for i in other.tr:
        other.ids[i] = torch.randint(1, V, other.ids[i].shape, generator=g)
    conf2, bias2, _ = refit(m, other, to_draft)
    assert torch.equal(conf, conf2) and torch.equal(bias, bias2)


def test_refit_mends_an_overconfident_head(target, data):
    """A head that says 'accepted' nearly always (bias +6) scores far worse than a constant on
    held-back positions; the refitted head scores at most the constant's BCE out of fold."""
    _, _, cfg, d = data
    m = model_for(target, cfg, d, conf_bias=6.0)
    to_draft = to_draft_of(d.draft_ids, V)
    conf, bias, report = refit(m, d, to_draft)
    assert report["bce_joint_head"] > 2 * report["bce_constant"]
    assert report["bce_out_of_fold"] <= report["bce_constant"] + 0.02
    x, y = samples(m, d, d.val, to_draft)
    assert bce(x, y, torch.cat([conf, bias]).double()) < report["bce_joint_head"] / 2


def test_too_few_held_back_sequences_are_refused(target, data):
    blob, feats, cfg, _ = data
    few = BlockData({k: v[:3] for k, v in blob.items()}, feats[:3], [0, 1], cfg.draft_vocab, target.cfg.stop_ids, 0)
    with pytest.raises(HalError, match="confidence refit: expected held-back sequences"):
        refit(model_for(target, cfg, few), few, to_draft_of(few.draft_ids, V))


def test_a_folder_that_cannot_be_refitted_is_refused_before_any_work(target, data, tmp_path):
    _, _, cfg, d = data
    with pytest.raises(HalError, match="config.json, got no such file"):
        refit_folder(tmp_path / "none", tmp_path / "out")
    m = model_for(target, cfg, d)
    write = lambda out, c: write_block(tmp_path / out, c, m.weights(), 0, LAYERS,  # noqa: E731
                                       (target.embed, target.head), vocab=V)
    write("b", cfg)
    with pytest.raises(HalError, match="--refit-confidence: expected a trained drafter's folder with train.json"):
        refit_folder(tmp_path / "b", tmp_path / "out")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text('{"architecture": "dspark-block"}')
    with pytest.raises(HalError, match="--refit-confidence: expected a DSpark drafter's folder, got .*retired "
                                       "dspark-block layout"):
        refit_folder(tmp_path / "old", tmp_path / "out")
    plain = replace(cfg, rank=0, confidence=Confidence.NONE, anchor_predicts=False)   # DFlash: no head to refit
    w = {n: t for n, t in m.weights().items() if n in plain.shapes(V) or n == "draft_ids"}
    write_block(tmp_path / "f", plain, w, 0, LAYERS, vocab=V)
    with pytest.raises(HalError, match="--refit-confidence: expected a drafter with a confidence head"):
        refit_folder(tmp_path / "f", tmp_path / "out")
    odd = replace(cfg, taps=(CANDIDATE_TAPS[0], 3))   # layer 3's input is not in the data cache
    write("c", odd)
    (tmp_path / "c" / "train.json").write_text('{"seed": 0}')
    with pytest.raises(HalError, match=r"--refit-confidence: expected taps the data records \(\[1, 2, 4, .*"
                                       r"got \[1, 3\]"):
        refit_folder(tmp_path / "c", tmp_path / "out")
    assert not (tmp_path / "out").exists()


class Chars:
    """A tokenizer for the tiny target: a character a token (ids 3 .. V - 1)."""

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text: str):
        return self.Enc([3 + ord(c) % (V - 3) for c in text[-24:]])


def test_the_response_cache_is_extended_cut_or_made_anew(target, tmp_path, monkeypatch):
    """``block_data.responses``: asking for more prompts than the cache holds generates only the
    new ones (the old sequences kept bit for bit), asking for fewer cuts it, and a cache of
    other prompts is made anew."""
    from hal.training import block_data
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    get = lambda n: block_data.responses("tiny", 3, n, target=target, tok=Chars())  # noqa: E731
    three = get(3)
    assert len(three["ids"]) == 3 and " + " not in three["made"]
    five = get(5)
    assert five["ids"][:3] == three["ids"] and len(five["ids"]) == 5 and five["made"].startswith(three["made"] + " + ")
    two = get(2)
    assert two["ids"] == three["ids"][:2] and two["texts"] == three["texts"][:2] and two["made"] == five["made"]
    path = block_data.cache_paths("tiny")[0]
    blob = torch.load(str(path), weights_only=False)
    torch.save({**blob, "texts": ["another prompt"] + blob["texts"][1:]}, str(path))
    again = get(2)
    assert again["texts"] == three["texts"][:2] and " + " not in again["made"]


def test_the_feature_cache_is_extended_or_made_anew_by_the_sequences_ids(target, tmp_path, monkeypatch):
    """``block_data.tapped`` (this target's taps standing in for the candidate layers): more
    sequences extend the cache, the old features kept bit for bit and only the new ones recorded;
    a cache whose sequences differ in one token (same lengths) is made anew. (Features are
    compared with records of the same batches: the recording forward is not batch-invariant.)"""
    from hal.training import block_data
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    monkeypatch.setattr(block_data, "CANDIDATE_TAPS", (1, 4))
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, V, (9 + i,), generator=g).tolist() for i in range(5)]
    three = block_data.tapped("tiny", {"ids": seqs[:3]}, target)
    five = block_data.tapped("tiny", {"ids": seqs}, target)
    assert len(five) == 5 and all(torch.equal(a, b) for a, b in zip(three, five))
    assert all(torch.equal(a, b) for a, b in zip(five[3:], block_data.record(target, seqs[3:])))
    other = [list(s) for s in seqs]
    other[1][4] = 3 if other[1][4] != 3 else 4
    again = block_data.tapped("tiny", {"ids": other}, target)
    assert all(torch.equal(a, b) for a, b in zip(again, block_data.record(target, other)))
    assert not torch.equal(again[1], five[1])


def test_the_prompt_sets_extend_each_other_and_a_bad_count_is_refused():
    from hal.training import data
    one, two, three = (data.prompts(sets=n) for n in (1, 2, 3))
    assert len(one) < len(two) < len(three) and two[:len(one)] == one and three[:len(two)] == two
    assert not set(three) & set(data.prompts(heldout=True))
    for bad in (0, 4, "3", 2.0, True):
        with pytest.raises(HalError, match=r"sets: expected 1, 2 or 3 prompt sets, got"):
            data.prompts(sets=bad)
