"""``train-head --kind dspark --layout dspark|dflash``: the training module in the published
architectures (Qwen3 layers, a frozen mask token, DSpark's anchor row, Markov table and
[h, markov_w1] confidence) drafts as the loaded folder does; `write_block` writes the authors' own
fixtures back exactly (names, shapes, config); a trained drafter in each layout is lossless."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hal.drafters.dspark import DSparkDrafter
from hal.errors import HalError
from hal.models.block_layouts import DFLASH, DSPARK, load_block, published_weights, read_layout, write_block
from hal.models.dspark import Confidence
from hal.models.llama import random_llama
from hal.training.dspark_train import DSparkTrain
from tests.drafters.test_dspark import config, lossless, view
from tests.drafters.test_eagle import D, FFN, H, HEADS, KV, LAYERS, V, target_features

FIXTURES = Path(__file__).parents[1] / "fixtures" / "drafters"
MASK = 5


@pytest.fixture(scope="module")
def target():
    return random_llama(H, LAYERS, HEADS, KV, D, FFN, V, seed=7, scale=0.15)


def published(arch: str):
    base = replace(config(block=4), draft_vocab=V)
    if arch == DSPARK:
        return replace(base, anchor_predicts=True, confidence=Confidence.MARKOV)
    return replace(base, rank=0, confidence=Confidence.NONE, anchor_predicts=False)


def copies(target, arch: str):
    """What a DSpark folder ships of the target (fp16, as written); DFlash borrows the target's own."""
    return (target.embed.half().float(), target.head.half().float()) if arch == DSPARK else (target.embed, target.head)


def module(target, arch: str, seed=0) -> DSparkTrain:
    embed, head = copies(target, arch)
    m = DSparkTrain(published(arch), embed, head, torch.arange(V), MASK, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # every weight away from its initial value, rounded through fp16 (as written)
        for name, p in m.p.items():
            if name != "mask":
                big = any(w in name for w in ("norm", "conf", "markov"))
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if big else 0.05))
                p.copy_(p.half().float())
        m.p["norm"].mul_(0.05)   # logits of a few units (the random lm_head's are tens): every bias shows in q
    return m


def disagreements(m: DSparkTrain, drafter: DSparkDrafter, target) -> list[str]:
    """Where ``drafter`` does not draft as the training module ``m``: greedy drafts, sampled
    rows (Markov bias and all) and DSpark's confidences, from scratch and after its cache grew."""
    ids = [(7 * i + 3) % V for i in range(30)]
    f = target_features(target, ids, m.cfg.taps)
    P, out = m.cfg.proposals, []
    for L, new, temp in ((12, slice(0, 11), 0.0), (17, slice(11, 16), 0.7)):
        p = drafter.propose(view(ids, L, f[new], k=P, temperature=temp))
        drafts = p.draft_token_ids.tolist()
        prev = torch.tensor([ids[L - 1]] + drafts[:-1])
        with torch.no_grad():
            base, h = m(f[None], torch.tensor(ids)[None], torch.tensor([[L - 1]]))
            rows = base[0, 0] + m.markov(prev)
        if temp and not torch.allclose(p.draft_probs, torch.softmax(rows / temp, -1), atol=1e-5, rtol=1e-4):
            out.append(f"sampled rows at {L}")
        if not temp and drafts != rows.argmax(-1).tolist():   # Markov-chained greedy, left to right
            out.append(f"greedy drafts at {L}")
        if m.cfg.confidence != Confidence.NONE and not torch.allclose(
                torch.tensor(drafter.confidences[0]), torch.sigmoid(m.confidence(h[0, 0], prev)), atol=1e-5, rtol=1e-5):
            out.append(f"confidences at {L}")
    return out


@pytest.mark.parametrize("arch", [DSPARK, DFLASH])
def test_the_written_folder_drafts_as_the_training_module(target, tmp_path, arch):
    m = module(target, arch)
    assert torch.equal(m.w("mask"), copies(target, arch)[0][MASK])
    assert write_block(tmp_path, m.cfg, m.weights(), MASK, LAYERS, copies(target, arch) if arch == DSPARK else None) \
        == arch
    layout = read_layout(tmp_path)
    assert layout.architecture == arch and layout.cfg == m.cfg and layout.mask_token == MASK
    assert disagreements(m, DSparkDrafter(load_block(tmp_path, target)), target) == []


@pytest.mark.parametrize("mutant, what", [
    ("_norm", lambda self, x, i, which: x),   # Qwen3's per-head q/k norms dropped
    ("markov", lambda self, prev: self.w["markov_w1"][(prev + 1) % V] @ self.w["markov_out"].T)])   # the wrong token
def test_planted_mutants_of_the_drafter_are_caught(target, tmp_path, monkeypatch, mutant, what):
    from hal.models.dspark import DSparkModel
    m = module(target, DSPARK)
    write_block(tmp_path, m.cfg, m.weights(), MASK, LAYERS, copies(target, DSPARK))
    monkeypatch.setattr(DSparkModel, mutant, what)
    assert disagreements(m, DSparkDrafter(load_block(tmp_path, target)), target)


@pytest.mark.parametrize("arch, folder", [(DSPARK, "dspark/tiny_dspark"), (DFLASH, "dflash/tiny_dflash")])
def test_the_authors_fixtures_are_written_back_as_they_are(tmp_path, arch, folder):
    """Read with spec-hal's reader, written with `write_block`: the same tensors under the same
    names (fp16 of the authors' fp32; DSpark's copies of the target's as they are), and a config
    that reads back to the same drafter."""
    src = FIXTURES / folder
    layout = read_layout(src)
    raw = load_file(str(src / "model.safetensors"))
    w = published_weights(raw, layout.cfg, src) | {"draft_ids": torch.arange(layout.cfg.draft_vocab)}
    copies = (raw["embed_tokens.weight"], raw["lm_head.weight"]) if arch == DSPARK else None
    write_block(tmp_path, layout.cfg, w, layout.mask_token, 6, copies)
    ours = load_file(str(tmp_path / "model.safetensors"))
    assert set(ours) == set(raw)
    for name, t in raw.items():
        assert torch.equal(ours[name], t if name in ("embed_tokens.weight", "lm_head.weight") else t.half()), name
    again = read_layout(tmp_path)
    assert again.cfg == layout.cfg and again.mask_token == layout.mask_token and again.architecture == arch
    theirs = json.loads((src / "config.json").read_text())
    mine = json.loads((tmp_path / "config.json").read_text())
    style = ("rope_theta", "dflash_config") if arch == DFLASH else ("rope_parameters", "target_layer_ids")
    assert all(k in mine and k in theirs for k in style)


def test_what_the_published_layouts_cannot_hold_is_refused_by_name(target, tmp_path):
    m = module(target, DSPARK)
    with pytest.raises(HalError, match="copies of the embeddings"):
        write_block(tmp_path, m.cfg, m.weights(), MASK, LAYERS)
    own = DSparkTrain(replace(config(), anchor_predicts=False), target.embed, target.head, torch.arange(0, V, 2), MASK)
    with pytest.raises(HalError, match="draft ids of the target.s vocabulary.*DFlash: no Markov"):
        write_block(tmp_path, own.cfg, own.weights(), MASK, LAYERS)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("arch", [DSPARK, DFLASH])
def test_training_in_a_published_layout_learns_and_drafts_losslessly(target, tmp_path, arch):
    """Sequences that follow a fixed permutation (test_dspark_training's): 200 steps propose
    most of the block (untrained: none; at test_dspark_training's rate 3e-3 DSpark's anchor row, which
    starts from the anchor's large random embedding, had learned 44%: measured); the written
    folder drafts losslessly."""
    from hal.training.block_data import CANDIDATE_TAPS
    from hal.training.dspark_train import train_block
    from tests.drafters.test_dspark_training import permutation_data
    seqs, feats, blob = permutation_data(target)
    cfg = replace(published(arch), layers=1, taps=CANDIDATE_TAPS[:2], rank=8 if arch == DSPARK else 0,
                  block=3 if arch == DSPARK else 4)   # 3 proposals each: positions anchor + 1 .. anchor + 3
    got = train_block(cfg, blob, feats, target, 10.0, batch=8, anchors=8, lr=1e-2, max_steps=200, mask_token=MASK,
                      say=lambda _: None)
    first, last = got["summary"]["curve"][0], got["summary"]["val"]
    assert first[4] < 0.5 and last["tau"] > 0.6 * cfg.proposals and last["top1"] > 0.8, (first, last)
    assert torch.equal(got["weights"]["mask"], target.embed[MASK].float()) and "confidence" not in got["summary"]
    write_block(tmp_path, cfg, got["weights"], MASK, LAYERS, (target.embed, target.head) if arch == DSPARK else None)
    lossless(target, DSparkDrafter(load_block(tmp_path, target)), [s[:12] for s in seqs[-3:]], k=cfg.proposals)


DRAFT = torch.tensor(sorted(set(range(0, V, 2)) | {1, 3, 5}))


@pytest.mark.parametrize("arch", [DSPARK, DFLASH])
def test_a_draft_vocabulary_is_written_as_a_token_map_and_drafts_as_trained(target, tmp_path, arch):
    """A drafter over a draft vocabulary (FR-Spec's hot tokens): the folder holds the whole
    vocabulary (``markov_w2`` zero outside the map) and `TOKEN_MAP`; spec-hal reads it back to
    the same drafts and probabilities over the map."""
    from hal.models.block_layouts import TOKEN_MAP
    embed, head = copies(target, arch)
    m = DSparkTrain(replace(published(arch), draft_vocab=len(DRAFT)), embed, head, DRAFT, MASK)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.p.items():
            if name != "mask":
                big = any(w in name for w in ("norm", "markov"))
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if big else 0.05))
                p.copy_(p.half().float())
        m.p["norm"].mul_(0.05)
    write_block(tmp_path, m.cfg, m.weights(), MASK, LAYERS, (embed, head) if arch == DSPARK else None, vocab=V)
    assert torch.equal(torch.load(tmp_path / TOKEN_MAP, weights_only=True), DRAFT)
    raw = load_file(str(tmp_path / "model.safetensors"))
    if arch == DSPARK:
        w2 = raw["markov_head.markov_w2.weight"]
        assert w2.shape == (V, m.cfg.rank) and not w2[~torch.isin(torch.arange(V), DRAFT)].any()
    assert read_layout(tmp_path).cfg.draft_vocab == V          # what a peer reads: the whole vocabulary
    model = load_block(tmp_path, target)
    assert torch.equal(model.draft_ids, DRAFT) and model.cfg == m.cfg
    drafter = DSparkDrafter(model)
    ids = [(7 * i + 3) % V for i in range(20)]
    f = target_features(target, ids, m.cfg.taps)
    p = drafter.propose(view(ids, 12, f[:11], k=m.cfg.proposals, temperature=0.7))
    prev = torch.tensor([ids[11]] + p.draft_token_ids.tolist()[:-1])
    with torch.no_grad():
        base, _ = m(f[None], torch.tensor(ids)[None], torch.tensor([[11]]))
        rows = base[0, 0] + m.markov(prev)
    full = torch.full((len(rows), V), float("-inf"))
    full[:, DRAFT] = rows
    torch.testing.assert_close(p.draft_probs, torch.softmax(full / 0.7, -1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([3, 3, 5]), "distinct token ids"), (torch.tensor([1, V]), r"distinct token ids in \[0, 96\)"),
    (torch.tensor([[1, 2]]), "shape"), (torch.tensor([0.5]), "float32"), ("not a tensor file", "expected a tensor")])
def test_a_bad_token_map_is_refused_by_name(target, tmp_path, bad, match):
    from hal.models.block_layouts import TOKEN_MAP
    m = module(target, DFLASH)
    write_block(tmp_path, m.cfg, m.weights(), MASK, LAYERS)
    if isinstance(bad, str):
        (tmp_path / TOKEN_MAP).write_text(bad)
    else:
        torch.save(bad, tmp_path / TOKEN_MAP)
    with pytest.raises(HalError, match=f"token_map.pt.*{match}"):
        load_block(tmp_path, target)


def test_options_the_published_layouts_cannot_take_are_refused_before_any_work(target, tmp_path):
    """`train-head --kind dspark`: an unknown layout (the retired dspark-block included) is refused
    before data or a model is touched, and so is a folder in that layout."""
    from hal.training.dspark_train import run
    for layout in ("eagle", "dspark-block"):
        with pytest.raises(HalError, match=r"--layout: expected one of \['dspark', 'dflash'\]"):
            run("no-such-model", tmp_path / "x", 1.0, layout=layout)
    assert not (tmp_path / "x").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text('{"architecture": "dspark-block", "hidden": 64}')
    with pytest.raises(HalError, match="retired dspark-block layout"):
        load_block(tmp_path / "old", target)


def test_a_mask_token_outside_the_vocabulary_is_refused_before_any_data_is_made(tmp_path, monkeypatch):
    from hal.training import block_data
    from hal.training.dspark_train import run
    monkeypatch.setattr(block_data, "responses", lambda *a, **k: pytest.fail("data made before the check"))
    with pytest.raises(HalError, match=r"--mask-token: expected an id in \[0, 49152\), got 49152"):
        run("smollm2-135m", tmp_path / "x", 1.0, layout="dspark", mask_token=49152)
    assert not (tmp_path / "x").exists()
