"""Training a block drafter (`hal.training.dspark_train`): it learns a predictable continuation
and writes a loadable drafter; the last layer's output as a tap, the soft labels it gives, and
the loss that mixes them with the hard labels."""

from __future__ import annotations

import pytest
import torch

from hal.errors import HalError
from hal.models.block_layouts import load_block, write_block
from hal.models.dspark import DSparkConfig
from hal.drafters.dspark import DSparkDrafter
from hal.training.dspark_train import DSparkTrain
from hal.models.llama import random_llama
from tests.drafters.test_dspark import DRAFT, MASK, TAPS, config, lossless, trained
from tests.drafters.test_eagle import D, FFN, H, HEADS, KV, LAYERS, V, target_features


@pytest.fixture(scope="module")
def target():
    return random_llama(H, LAYERS, HEADS, KV, D, FFN, V, seed=7, scale=0.15)   # test_dspark's target


def permutation_data(target, n: int = 48, length: int = 30):
    """(sequences, features, blob) in the data cache's layout: ``n`` sequences that follow a fixed
    permutation of the vocabulary, every candidate tap recorded (this target fills the first two)."""
    from hal.training.block_data import CANDIDATE_TAPS
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(V - 1, generator=g) + 1
    seqs = []
    for _ in range(n):
        t, s = int(torch.randint(1, V, (1,), generator=g)), [2, 9]
        for _ in range(length):
            s.append(t)
            t = int(perm[t - 1])
        seqs.append(s)
    feats = []
    for s in seqs:
        f = torch.zeros(len(s), len(CANDIDATE_TAPS), H)
        f[:, :2] = target_features(target, s, CANDIDATE_TAPS[:2]).view(len(s), 2, H)
        feats.append(f.half())
    return seqs, feats, {"ids": seqs, "prompt_lens": [8] * len(seqs), "texts": ["x"] * len(seqs)}


def test_training_learns_a_predictable_continuation_and_writes_a_loadable_drafter(target, tmp_path):
    """Sequences that follow a fixed permutation of the vocabulary: a DSpark drafter trained for
    200 steps proposes the whole block (validation tau near B = 4; untrained, near 0), and its
    confidence head refitted on the held-back sequences is the one written."""
    from hal.training.block_data import CANDIDATE_TAPS
    from hal.training.dspark_train import train_block
    seqs, feats, blob = permutation_data(target)
    cfg = DSparkConfig(hidden=H, heads=HEADS, kv_heads=KV, head_dim=D, ffn=FFN, layers=1, taps=CANDIDATE_TAPS[:2],
                      block=4, rank=8, draft_vocab=V)
    got = train_block(cfg, blob, feats, target, 10.0, batch=8, anchors=8, lr=1e-2, max_steps=200, say=lambda _: None,
                      refit_confidence=True)
    first, last = got["summary"]["curve"][0], got["summary"]["val"]
    assert first[4] < 0.5 and last["tau"] > 3.0 and last["top1"] > 0.8, (first, last)
    refit = got["summary"]["confidence"]   # on the 2 held-back sequences: the head saved is the refitted one
    assert refit["positions"] > 0 and refit["bce_out_of_fold"] == min(refit["bce_by_choice"].values())
    conf = got["weights"]["conf"]
    assert bool(conf[:H].any()) == (refit["inputs"] != "markov row")   # weights outside the chosen set: zero
    assert bool(conf[H:].any()) == (refit["inputs"] != "hidden")
    write_block(tmp_path / "b", cfg, got["weights"], 0, LAYERS, (target.embed, target.head), vocab=V)
    drafter = DSparkDrafter(load_block(tmp_path / "b", target))
    dec = lossless(target, drafter, [s[:12] for s in seqs[-3:]])
    assert dec.metrics.total.num_draft_tokens > 0


def test_the_last_layers_output_is_a_tap_and_its_soft_labels_are_the_targets_greedy_choice(target):
    """Tap ``LAYERS`` is the last layer's output: through the target's final norm and lm_head
    rows it gives the target's own next-token distribution over the draft vocabulary (1e-5), and
    on the target's greedy continuation the soft labels of each block position peak at the
    token that follows (row a + j - 1 predicts position a + j: an off-by-one fails)."""
    from hal.training.dspark_train import soft_labels
    ids = [2, 9, 5]
    while len(ids) < 26:   # the target's greedy continuation, one full forward a token
        ids.append(int(target_logits(target, ids)[-1].argmax()))
    logits = target_logits(target, ids)
    last = target_features(target, ids, (LAYERS,))
    both = target_features(target, ids, (4, LAYERS))
    assert torch.equal(both[:, H:], last) and torch.equal(both[:, :H], target_features(target, ids, (4,)))
    with pytest.raises(HalError, match="feature_layers: expected distinct layer indices"):
        target_features(target, ids, (LAYERS, 4))
    model = DSparkTrain(config(), target.embed, target.head, DRAFT, MASK, 0, target.w["norm"])
    torch.testing.assert_close(model.teacher(last), torch.softmax(logits[:, DRAFT], -1), atol=1e-5, rtol=1e-5)
    anchors = torch.tensor([[3, 10, 20]])
    p = soft_labels(model, last[None], anchors)                        # [1, 3, P, Vd]
    at = anchors[0, :, None] + torch.arange(1, model.cfg.proposals + 1)
    want = torch.tensor(ids)[at]
    inside = torch.isin(want, DRAFT)
    assert inside.sum() >= 4
    assert torch.equal(DRAFT[p[0].argmax(-1)][inside], want[inside])


def target_logits(target, ids: list[int]) -> torch.Tensor:
    from hal import kv
    from hal.engine.forward import forward_tokens
    pool = kv.KVPool(target.be, 8, 16, KV, D, num_layers=LAYERS)
    return forward_tokens(target, pool, [pool.sequence()], [len(ids)], torch.tensor(ids),
                          rows=torch.arange(len(ids)))[0]


def test_the_distilled_loss_mixes_hard_and_soft_labels_over_every_valid_position(target):
    """``distill`` = 1 is the weighted soft cross-entropy over every valid position (a label
    outside the draft vocabulary included); 0.5 is the mean of it and the hard one."""
    from hal.training.dspark_train import DECAY, losses, soft_labels
    ids = torch.tensor([[(7 * i + 3) % V for i in range(24)]])
    f = target_features(target, ids[0].tolist(), TAPS)[None]
    last = target_features(target, ids[0].tolist(), (LAYERS,))[None]
    model = trained(target)
    model.final_norm = target.w["norm"]
    to_draft = torch.full((V,), -1, dtype=torch.long)
    to_draft[DRAFT] = torch.arange(len(DRAFT))
    anchors, lens = torch.tensor([[2, 9, 19]]), torch.tensor([24])
    hard = losses(model, f, ids, anchors, lens, to_draft)[0]
    soft = losses(model, f, ids, anchors, lens, to_draft, last, 1.0)[0]
    half = losses(model, f, ids, anchors, lens, to_draft, last, 0.5)[0]
    with torch.no_grad():
        base, _ = model(f, ids, anchors)
        at = anchors[0, :, None] + torch.arange(1, 5)   # the anchor's row proposes too: 4 rows
        rows = base[0] + model.markov(ids[0][at - 1])
        valid = at < 24
        p = soft_labels(model, last, anchors)[0]
        w = torch.exp(-torch.arange(4) / DECAY).expand_as(at)
        want = ((-(p * torch.log_softmax(rows, -1)).sum(-1) * w)[valid].sum() / w[valid].sum())
    torch.testing.assert_close(soft, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(half, (hard + soft) / 2, atol=1e-5, rtol=1e-5)
    assert abs(float((soft - hard).detach())) > 1e-3


@pytest.mark.parametrize("taps, distill, match", [
    ((1, 4), 1.5, r"distill: expected a share in \[0, 1\], got 1.5"),
    ((1, 4), -0.1, r"distill: expected a share in \[0, 1\]"),
    ((1, 4, 6), 0.0, r"taps: expected layers the data records")])
def test_bad_training_options_are_refused_before_training(target, taps, distill, match):
    """A share of soft labels outside [0, 1], or a tap the data does not record, is a HalError
    naming the option before any step."""
    from hal.training.dspark_train import train_block
    blob = {"ids": [[2, 9, 5, 7]] * 4, "prompt_lens": [2] * 4, "texts": ["x"] * 4}
    cfg = DSparkConfig(**{**config().__dict__, "taps": taps})
    with pytest.raises(HalError, match=match):
        train_block(cfg, blob, [torch.zeros(4, 10, H).half()] * 4, target, 1.0, distill=distill, max_steps=1)
