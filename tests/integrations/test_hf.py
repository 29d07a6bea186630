"""hal.integrations.hf: an HF transformers causal LM as the target, our drafters and verify
ops around it. On a tiny random Llama built here (fp64, so the one-token and the
multi-token forward agree far below any gap between logits): greedy output identical to
HF's own ``generate``, with drafts on the cpu backend and on the cuda backend (Triton
interpreter); a planted off-by-one in the cache crop is caught; sampling is seeded."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hal  # noqa: E402
from hal.drafters import NgramDrafter  # noqa: E402
from hal.integrations import hf  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
           [20, 21, 22, 23, 24, 20, 21, 22]]


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=63,
                                   bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():   # sharper logits: a random model's are nearly flat
        m.lm_head.weight.mul_(8)
    return m


def hf_greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)


def backends():
    out = ["cpu"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append("cuda")
    return out


@pytest.mark.parametrize("draft_backend", backends())
def test_greedy_equals_hf_generate(model, draft_backend):
    be, dbe = hal.get_backend("cpu"), hal.get_backend(draft_backend)
    stats = {}
    for ids in PROMPTS:
        want = hf_greedy(model, ids, 24)
        with torch.no_grad():
            got = hf.generate(model, torch.tensor([ids]), drafter=NgramDrafter(dbe), backend=be, max_new_tokens=24,
                              k=4, stats=stats)
        assert got.tolist() == want.tolist(), ids
    assert stats["accepted"] > 0 and stats["drafted"] > stats["accepted"] / 2   # drafts were verified and used


def test_plain_and_eos(model):
    be = hal.get_backend("cpu")
    ids = PROMPTS[0]
    want = hf_greedy(model, ids, 16)
    with torch.no_grad():
        assert hf.generate(model, torch.tensor([ids]), backend=be, max_new_tokens=16).tolist() == want.tolist()
        eos = want[0, len(ids) + 3].item()
        got = hf.generate(model, torch.tensor([ids]), drafter=NgramDrafter(be), backend=be, max_new_tokens=16,
                          eos_token_id=eos)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    assert got[0, -1].item() == eos and got.tolist() == ref.tolist()


def test_planted_off_by_one_crop_is_caught(model, monkeypatch):
    """PLANTED: the cache keeps one token too many after verification."""
    be = hal.get_backend("cpu")
    orig = transformers.DynamicCache.crop
    monkeypatch.setattr(transformers.DynamicCache, "crop", lambda self, n: orig(self, n + 1) if n + 1 < 0 else None)
    diffs = 0
    for ids in PROMPTS:
        with torch.no_grad():
            got = hf.generate(model, torch.tensor([ids]), drafter=NgramDrafter(be), backend=be, max_new_tokens=24, k=4)
        diffs += got.tolist() != hf_greedy(model, ids, 24).tolist()
    assert diffs > 0


def test_sampling_is_seeded(model):
    be = hal.get_backend("cpu")
    ids = torch.tensor([PROMPTS[1]])

    def run(seed):
        with torch.no_grad():
            return hf.generate(model, ids, drafter=NgramDrafter(be), backend=be, max_new_tokens=20, k=3,
                               temperature=1.0, seed=seed).tolist()
    assert run(1) == run(1)
    assert len({str(run(s)) for s in range(4)}) > 1


def test_bad_arguments(model):
    with pytest.raises(hal.HalError, match="input_ids"):
        hf.generate(model, torch.tensor([1, 2]))
    with pytest.raises(hal.HalError, match="max_new_tokens"):
        hf.generate(model, torch.tensor([[1, 2]]), max_new_tokens=0)
