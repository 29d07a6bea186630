"""Host syncs on the decode path: one per step, the readback of the verify result.

A sync is any read of tensor values by the host (``tolist``, ``item``, ``cpu``,
``numpy``, ``bool``/``int``/``float``/``index`` of a tensor). They are counted on the
engine path (scheduler, drafters, model runner), outside the backend's ops (whose
value checks run only where the backend asks for them, e.g. cpu) and outside
`hal.engine.forward.readback`, which counts once per call. On CPU every tensor is a host
tensor, so the engine keeps host data as Python lists and the count is exact."""

from __future__ import annotations

import pytest
import torch

import hal
import hal.engine.step_types
from hal.engine import Request, SpeculativeDecoder
from hal.drafters import ModelDrafter, NgramDrafter
from tests.drafters.toy_heads import ToyEagleDrafter
from hal.drafters.eagle import EagleDrafter
from hal.models.loaders import load_safetensors
from tests.launch.test_generate import tiny  # noqa: F401  (the fixture: a tiny random model folder)

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class Counter:
    def __init__(self):
        self.count, self.depth, self.where = 0, 0, []

    def suspend(self, fn):
        def call(*a, **kw):
            self.depth += 1
            try:
                return fn(*a, **kw)
            finally:
                self.depth -= 1
        return call


class Quiet:
    """A backend (or its ``impl``) whose ops do not count: an op's own reads are the backend's business."""

    def __init__(self, inner, counter: Counter):
        self._inner, self._c = inner, counter

    def __getattr__(self, name):
        v = getattr(self._inner, name)
        if name == "impl":
            return Quiet(v, self._c)
        return self._c.suspend(v) if callable(v) and not isinstance(v, type) else v


@pytest.fixture
def counter(monkeypatch):
    c = Counter()
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def read(self, *a, _orig=orig, _name=name, **kw):
            if c.depth == 0:
                c.count += 1
                import traceback
                c.where.append(f"{_name}: " + "".join(traceback.format_stack(limit=4)[:-1]))
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, read)
    orig_rb = hal.engine.step_types.readback

    def readback(*tensors):
        if tensors and c.depth == 0:
            c.count += 1
        return c.suspend(orig_rb)(*tensors)
    monkeypatch.setattr(hal.engine.step_types, "readback", readback)
    return c


PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7],
           [11, 12, 11, 12, 11]]


def drafters(model):
    return {"ngram": lambda: NgramDrafter(model.be),
            "self-speculative": lambda: ModelDrafter(model.layer_view(1), num_blocks=64),
            "eagle-toy": lambda: ToyEagleDrafter(lambda h, x: (torch.nn.functional.one_hot(x, model.cfg.vocab).float(), h),
                                              model.be),
            "eagle-head": lambda: EagleDrafter(random_head(model), num_blocks=64)}


def random_head(model):
    """An EAGLE-1 head with random weights over half the vocabulary (FR-Spec's d2t)."""
    from hal.models.eagle import EagleConfig, EagleModel
    c = model.cfg
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    w = {"fc": r(c.hidden, 2 * c.hidden), "fc_bias": r(c.hidden), "ffn_norm": 1 + r(c.hidden),
         "wqkv": r((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden), "wo": r(c.hidden, c.heads * c.head_dim),
         "wgu": r(2 * c.ffn, c.hidden), "wdown": r(c.hidden, c.ffn), "draft_ids": torch.arange(0, c.vocab, 2)}
    return EagleModel(EagleConfig(1, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, 10000.0, c.eps), w, model)


@pytest.mark.parametrize("drafter", ["ngram", "self-speculative", "eagle-toy", "eagle-head", "none"])
@pytest.mark.parametrize("mixed", [False, True])
def test_one_host_sync_per_decode_step(tiny, counter, drafter, mixed):  # noqa: F811
    """Every step reads the device once (steps with nothing to read: zero), whatever the
    drafter, with greedy and sampled requests mixed."""
    counter.depth += 1   # building the model and queueing requests is not the decode path
    model = load_safetensors(tiny, Quiet(hal.get_backend("cpu"), counter))
    d = None if drafter == "none" else drafters(model)[drafter]()
    dec = SpeculativeDecoder(model, d, num_blocks=64)
    for i, p in enumerate(PROMPTS):
        sampled = mixed and i % 2
        dec.add(Request(p, max_new_tokens=10, k=3, temperature=0.8 if sampled else 0.0, seed=i,
                        top_p=0.9 if sampled and i == 1 else 1.0, top_k=5 if i == 3 else 0))
    counter.depth -= 1
    steps, decode_steps = 0, 0
    while dec.has_unfinished() and steps < 100:
        counter.count, counter.where = 0, []
        decoding = bool(dec.running)
        out = dec.step()
        steps += 1
        assert counter.count <= 1, f"step {steps}: {counter.count} host syncs:\n" + "\n".join(counter.where)
        if decoding and out.tokens:
            decode_steps += 1
            assert counter.count == 1
    assert not dec.has_unfinished() and decode_steps >= 3
    assert dec.pool.allocator.num_free == dec.pool.allocator.num_blocks


class OutsideLookahead(NgramDrafter):
    """The n-gram drafter called before the verify forward (not as a lookahead): the engine
    reads its device counts (`Proposal.num_valid`) once more before the forward."""

    lookahead = False


class ListDrafter(OutsideLookahead):
    """PLANTED: the old way, drafts read back to Python lists inside the drafter."""

    def propose(self, b):
        prop = super().propose(b)
        ids = torch.tensor(prop.draft_token_ids.tolist())   # the read the engine must see
        return type(prop)(draft_token_ids=ids, cu_num_draft_tokens=prop.cu_num_draft_tokens, num_valid=prop.num_valid)


def syncs_of_a_decode_step(tiny, counter, drafter_type) -> int:
    counter.depth += 1
    model = load_safetensors(tiny, Quiet(hal.get_backend("cpu"), counter))
    dec = SpeculativeDecoder(model, drafter_type(model.be), num_blocks=64)
    dec.add(Request(PROMPTS[0], max_new_tokens=10, k=3))
    dec.step()   # prefill
    counter.depth -= 1
    counter.count = 0
    dec.step()
    return counter.count


def test_a_drafter_that_reads_back_is_counted(tiny, counter):  # noqa: F811
    base = syncs_of_a_decode_step(tiny, counter, OutsideLookahead)
    assert base == 2, counter.where   # the drafts' counts, then the step's one readback
    assert syncs_of_a_decode_step(tiny, counter, ListDrafter) == base + 1, counter.where
