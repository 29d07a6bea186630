"""``train-head --kind eagle``: the EAGLE-3 training module runs the maths the engine's head runs
(its first step at every position and its chained steps), `write_eagle3` writes SafeAILab's
original layout (the tensor names of the authors' own fixture), and a trained head drafts
losslessly and well."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hal import kv
from hal.drafters.eagle import EagleDrafter
from hal.engine.forward import forward_tokens, make_batch
from hal.errors import HalError
from hal.models.eagle import EagleConfig
from hal.models.eagle_layouts import load_eagle, write_eagle3
from hal.models.llama import random_llama
from hal.training.eagle_train import EagleTrain, eagle3_taps, train_eagle
from tests.drafters.test_eagle import lossless

H, HEADS, KV, D, FFN, V, LAYERS = 64, 4, 2, 16, 128, 96, 30   # 30 layers: the taps SmolLM2-135M's data records
DRAFT = torch.tensor(sorted(set(range(0, V, 2)) | {1, 3, 5}))
FIXTURE = Path(__file__).parents[1] / "fixtures" / "drafters" / "eagle3" / "tiny_head"


@pytest.fixture(scope="module")
def target():
    return random_llama(H, LAYERS, HEADS, KV, D, FFN, V, seed=7, scale=0.15)


def config() -> EagleConfig:
    return EagleConfig(version=3, hidden=H, heads=HEADS, kv_heads=KV, head_dim=D, ffn=FFN, rope_base=10000.0,
                       eps=1e-5, feature_layers=eagle3_taps(LAYERS), draft_vocab=len(DRAFT))


def random_module(target, seed=0) -> EagleTrain:
    """A module with every weight away from its initial value, rounded through fp16 (as written)."""
    m = EagleTrain(config(), target.embed, target.head[DRAFT], seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.p.items():
            p.add_(torch.randn(p.shape, generator=g) * (0.2 if name.endswith("norm") else 0.05))
            p.copy_(p.half().float())
    return m


def taps_of(target, ids):
    pool = kv.KVPool(target.be, 8, 16, KV, D, num_layers=LAYERS)
    rows = torch.arange(len(ids))
    return forward_tokens(target, pool, [pool.sequence()], [len(ids)], torch.tensor(ids), rows=rows[-1:],
                          hidden_rows=rows, feature_layers=eagle3_taps(LAYERS))[1]


def answers_data(target, n: int, new: int, seed: int):
    """(sequences, features, blob) as `block_data` records them: the target's greedy answers
    (``new`` tokens) to ``n`` random 6-token prompts."""
    from hal.engine import SpeculativeDecoder
    from hal.engine.requests import Request
    from hal.training import block_data
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (6,), generator=g).tolist() for _ in range(n)]
    answers = SpeculativeDecoder(target, None).generate([Request(p, max_new_tokens=new, k=0) for p in prompts])
    seqs = [p + a for p, a in zip(prompts, answers)]
    return seqs, block_data.record(target, seqs), {"ids": seqs, "prompt_lens": [6] * n, "texts": ["x"] * n}


def test_the_written_head_is_the_training_module_at_every_position_and_chained_step(target, tmp_path):
    m = random_module(target)
    write_eagle3(tmp_path, m.cfg, m.weights() | {"draft_ids": DRAFT}, V, LAYERS)
    head = load_eagle(tmp_path, target)
    assert head.cfg.version == 3 and head.feature_layers == (2, 15, 27) and torch.equal(head.draft_ids, DRAFT)
    ids = [(7 * i + 3) % V for i in range(40)]
    n = 36                                        # committed pairs (f_t, x_{t+1}), t < n; then two chained steps
    f = taps_of(target, ids)
    with torch.no_grad():
        want = m(torch.cat([f[:n], torch.zeros(len(ids) - n, f.shape[1])])[None], torch.tensor(ids)[None])
    pool = kv.KVPool(head.be, 8, 16, KV, D, num_layers=1)
    seq = pool.sequence()
    toks = torch.tensor(ids[1:n + 1])
    b = make_batch(head.be, head.device, pool, [seq], [n], toks, all_rows=True)
    logits, h = head.forward(b, pool.k[0], pool.v[0], toks, f[:n], True)
    seq.commit(n)
    torch.testing.assert_close(logits, want[0][0, :n], atol=2e-4, rtol=1e-4)   # fp32, summation order apart
    for j in (1, 2):                              # a chained step reads the head's own output, at position n + j - 1
        tok = torch.tensor(ids[n + j:n + j + 1])
        b = make_batch(head.be, head.device, pool, [seq], [1], tok, all_rows=True)
        logits, h = head.forward(b, pool.k[0], pool.v[0], tok, h[-1:], False)
        seq.commit(1)
        torch.testing.assert_close(logits[0], want[j][0, n - 1], atol=2e-4, rtol=1e-4)


def test_the_layout_is_safeailabs(target, tmp_path):
    """The tensor names, dtypes and config keys of the authors' own EAGLE-3 fixture
    (`scripts/oracles/eagle3_reference.py`: SafeAILab's original layout, written by their code's
    key names), and t2d marks exactly the draft ids."""
    m = random_module(target)
    write_eagle3(tmp_path, m.cfg, m.weights() | {"draft_ids": DRAFT}, V, LAYERS)
    from safetensors.torch import load_file
    ours = load_file(str(tmp_path / "model.safetensors"))
    theirs = torch.load(str(FIXTURE / "pytorch_model.bin"), weights_only=True)
    assert set(ours) == set(theirs) - {"embed_tokens.weight"}
    assert {n: t.dtype for n, t in ours.items()} == {n: theirs[n].dtype for n in ours}
    c, ref = json.loads((tmp_path / "config.json").read_text()), json.loads((FIXTURE / "config.json").read_text())
    assert c["architectures"] == ref["architectures"] and "rope_theta" not in c and "eagle_config" not in c
    assert torch.equal(ours["t2d"].nonzero()[:, 0], DRAFT)
    assert torch.equal(ours["d2t"] + torch.arange(len(DRAFT)), DRAFT)
    other = EagleConfig(**{**config().__dict__, "feature_layers": (1, 15, 29)})
    write_eagle3(tmp_path / "o", other, m.weights() | {"draft_ids": DRAFT}, V, LAYERS)
    assert load_eagle(tmp_path / "o", target).feature_layers == (1, 15, 29)
    with pytest.raises(HalError, match="write_eagle3: expected a plain EAGLE-3 head"):
        write_eagle3(tmp_path / "x", EagleConfig(**{**config().__dict__, "rope_base": 5e5}), m.weights(), V, LAYERS)


def test_training_learns_the_targets_answers_and_writes_a_head_that_drafts_them(target, tmp_path):
    """The target's own greedy answers to random prompts (what `block_data` records): in 150 steps
    the cross-entropy falls tenfold and every chained step's held-back top-1 rises from chance
    (1%) past 15% (a random 30-layer target is hard to imitate from 38 sequences: measured 18-24%),
    and the written head drafts losslessly, some drafts accepted."""
    seqs, feats, blob = answers_data(target, 40, 30, seed=0)
    got = train_eagle(target, blob, feats, 10.0, draft_size=64, batch=8, lr=3e-3, max_steps=150, say=lambda _: None)
    s = got["summary"]
    first, last = got["curve"][0], got["curve"][-1]
    assert first[4] < 0.05 and last[2] < 0.1 * first[2] and min(s["val"]["top1"]) > 0.15, (first, last, s)
    write_eagle3(tmp_path, got["config"], got["weights"], V, LAYERS)
    dec = lossless(target, EagleDrafter(load_eagle(tmp_path, target)), [q[:8] for q in seqs[-3:]])
    t = dec.metrics.total
    assert t.num_accepted_tokens > 0 and t.num_draft_tokens > 0


def test_taps_the_data_does_not_record_are_refused_by_name(target):
    small = random_llama(H, 8, HEADS, KV, D, FFN, V, seed=7, scale=0.15)   # taps (2, 4, 5): 5 is not recorded
    blob = {"ids": [[2, 9, 5, 7]] * 4, "prompt_lens": [2] * 4, "texts": ["x"] * 4}
    with pytest.raises(HalError, match=r"taps: expected layers the data records .* got \[5\]"):
        train_eagle(small, blob, [torch.zeros(4, 12, H).half()] * 4, 1.0, draft_size=16, max_steps=1)


def test_training_continues_from_a_written_head_and_refuses_one_of_other_data(target, tmp_path):
    """``--init``: a run continued from a written head starts where it ended (its first step's
    loss is the written head's, not a fresh one's); a head of another draft vocabulary is refused."""
    from hal.models.eagle_layouts import read_head
    seqs, feats, blob = answers_data(target, 24, 20, seed=2)
    kw = dict(draft_size=64, batch=8, lr=3e-3, say=lambda _: None)
    first = train_eagle(target, blob, feats, 10.0, max_steps=60, **kw)
    write_eagle3(tmp_path, first["config"], first["weights"], V, LAYERS)
    start = read_head(tmp_path, LAYERS)[1]
    again = train_eagle(target, blob, feats, 10.0, max_steps=1, init=start, **kw)
    fresh = train_eagle(target, blob, feats, 10.0, max_steps=1, **kw)
    assert again["curve"][0][2] < 0.5 * fresh["curve"][0][2], (again["curve"][0], fresh["curve"][0])
    other = dict(start, draft_ids=start["draft_ids"].flip(0))
    with pytest.raises(HalError, match="--init: expected a head of this target and data"):
        train_eagle(target, blob, feats, 10.0, max_steps=1, init=other, **kw)
