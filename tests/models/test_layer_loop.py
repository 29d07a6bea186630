"""The native layer loop (`hal.models.layer_loop`): a model whose layers run int4 as stored
computes, with the loop, the same bits as without it (the Python loop over the same row
kernels) for decodes, verifies, batches, trees and EAGLE feature taps, and writes the same
KV cache (int4pack's form with bfloat16 and float32 rows, and the q4q8 kernel's); it refuses
bad arguments; a C++ compiler that fails leaves the Python loop, with a warning. Shapes are SmolLM2-135M's (9 query / 3 KV heads of 64, hidden 576, ffn 1536), 3
layers, random int4 weights, a small vocabulary."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import hal
from hal.engine import trees
from hal.engine.forward import forward, forward_tokens
from hal.errors import HalError
from hal.kv import KVPool
from hal.models import int4, layer_loop, q4_rows
from hal.models.invariant import KeyLists
from hal.models.linear_layout import LinearPlan
from hal.models.k_quants import MixedWeight
from hal.models.llama import Llama, LlamaConfig
from tests.models.compilers import plant_failing_compiler

LAYERS, V = 3, 512


def _weights(dtype: torch.dtype, seed: int = 0, form: str = "int4",
             extras: bool = False, q8: bool | str = False) -> tuple[LlamaConfig, dict]:
    """``extras``: the families' additions too (q/k/v and o biases as Llama's attention_bias, Qwen3's q/k norms);
    ``q8``: qkv and down in Q8 tiles (a file's Q8_0 layers), the others Q4; ``"mixed"``: a K-quant file's tiles (Q5, Q8, Q4K, Q6)."""
    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(hidden=576, layers=LAYERS, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=V,
                      rope_base=10000.0, eps=1e-5, rope_interleaved=not extras, qkv_bias=extras, o_bias=extras,
                      qk_norm=extras)
    w = {"embed": torch.randn(V, 576, generator=g), "norm": 1 + 0.1 * torch.randn(576, generator=g)}
    for i in range(LAYERS):
        w[f"{i}.attn_norm"] = 1 + 0.1 * torch.randn(576, generator=g)
        w[f"{i}.ffn_norm"] = 1 + 0.1 * torch.randn(576, generator=g)
        for name, (n, k) in {"wqkv": (960, 576), "wo": (576, 576), "wgu": (3072, 576), "wdown": (576, 1536)}.items():
            if q8 == "mixed":   # a K-quant file's: rows of 576 (not K-quants) in Q5 and Q8 tiles, as llama-quantize
                # leaves them (qkv: two parts), down's rows of 1536 in Q4K and Q6 tiles (two parts)
                w[f"{i}.{name}"] = MixedWeight((q4_rows.random_q5(768, k, g, dtype), q4_rows.random_q8(192, k, g, dtype))) \
                    if name == "wqkv" else MixedWeight((q4_rows.random_q4k(384, k, g, dtype),
                                                        q4_rows.random_q6k(192, k, g, dtype))) \
                    if name == "wdown" else q4_rows.random_q5(n, k, g, dtype)
            elif q8 and name in ("wqkv", "wdown"):   # a file's Q8_0 layers: q4q8's Q8 tiles beside Q4 ones
                w[f"{i}.{name}"] = q4_rows.random_q8(n, k, g, dtype)
            else:
                w[f"{i}.{name}"] = q4_rows.pack(q4_rows.random(n, k, g), dtype) if form == "q4q8" else \
                    int4.random(n, k, g).pack(dtype)
        if extras:
            w[f"{i}.bqkv"], w[f"{i}.bo"] = torch.randn(960, generator=g), torch.randn(576, generator=g)
            w[f"{i}.q_norm"], w[f"{i}.k_norm"] = (1 + 0.3 * torch.randn(64, generator=g) for _ in range(2))
    return cfg, w


@pytest.fixture(scope="module", params=[(torch.bfloat16, "int4", False, False), (torch.float32, "int4", False, False),
                                        (torch.bfloat16, "q4q8", False, False), (torch.bfloat16, "q4q8", True, False),
                                        (torch.bfloat16, "q4q8", False, True), (torch.bfloat16, "q4q8", True, "mixed")],
                ids=["bfloat16", "float32", "q4q8", "q4q8-biases-qk-norms", "q4q8-q8-layers", "q4q8-k-quants"])
def twins(request):
    """The same weights with the native loop and without it (widths 1/2/4/8: verifies pad); one
    with the families' extras (biases, Qwen3's q/k norms, NEOX RoPE), one with Q8 tiles beside Q4."""
    dtype, form, extras, q8 = request.param
    cfg, w = _weights(dtype, form=form, extras=extras, q8=q8)
    plan = LinearPlan("mm", dtype, (1, 2, 4, 8), weights=form)
    be = hal.get_backend("cpu")
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler on this machine: the Python loop runs (the warning is tested below)")
    native, python = Llama(cfg, w, be, plan=plan), Llama(cfg, w, be, plan=plan, native_loop=False)
    assert native.loop is not None and python.loop is None, "the layer loop did not build or apply here"
    return native, python


PROMPT = [(7 * i + 3) % V for i in range(21)]


def _run(model, feeds, tree=None, feature_layers=()):
    """Prefill two requests, then one forward of ``feeds`` (a list per request): all rows'
    logits, the returned features, and the caches."""
    pool = KVPool(model.be, 32, 16, 3, 64, dtype=model.dtype, num_layers=LAYERS)
    seqs = [pool.sequence(), pool.sequence()]
    for s, prompt in zip(seqs, (PROMPT, (PROMPT * 2)[:40])):
        forward(model, pool, [s], [prompt], False)
        s.commit(len(prompt))
    use = seqs[:len(feeds)]
    if tree is None:
        logits, out = forward(model, pool, use, feeds, True)
    else:
        parents = torch.tensor(tree)
        depth, mask = trees.layout(parents, [len(tree)], [], torch.device("cpu"))
        logits, out = forward_tokens(model, pool, use[:1], [len(tree) + 1], torch.tensor(feeds[0]), all_rows=True,
                                     tree_mask=mask, depth=depth)   # the root (the last token), then the drafts
    return logits, out, pool.k, pool.v


@pytest.mark.parametrize("feeds", [[[5]], [[5, 6, 7, 8, 9]], [[5], [6]], [[5, 6, 7], [8, 9, 10, 11, 12, 13]]],
                         ids=["decode", "verify-5", "batch-2", "ragged"])
def test_the_loop_gives_the_python_loops_bits(twins, feeds):
    native, python = twins
    a, b = _run(native, feeds), _run(python, feeds)
    assert torch.equal(a[0], b[0]), "logits differ"
    assert all(torch.equal(x, y) for x, y in zip(a[2] + a[3], b[2] + b[3])), "the KV caches differ"


def test_long_batches_split_across_threads_give_the_python_loops_bits(twins):
    """Enough keys that the loop splits the attention's units across torch's threads (two
    requests of 300 cached tokens verifying 6 each): the single-threaded Python loop's bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)   # make test runs at one thread: two here, so the units are split
    try:
        got = _long_runs(twins)
    finally:
        torch.set_num_threads(threads)
    (a, ka, va), (b, kb, vb) = got
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ka + va, kb + vb))


def _long_runs(twins):
    got = []
    for model in twins:
        pool = KVPool(model.be, 48, 16, 3, 64, dtype=model.dtype, num_layers=LAYERS)
        seqs = [pool.sequence(), pool.sequence()]
        for n, s in enumerate(seqs):
            prompt = [(11 * i + 5 * n) % V for i in range(300)]
            forward(model, pool, [s], [prompt], False)
            s.commit(len(prompt))
        got.append((forward(model, pool, seqs, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], True)[0], pool.k, pool.v))
    return got


def test_trees_and_feature_taps_give_the_python_loops_bits(twins):
    native, python = twins
    a, b = _run(native, [[4, 5, 6, 7, 8]], tree=[-1, 0, 0, 1]), _run(python, [[4, 5, 6, 7, 8]], tree=[-1, 0, 0, 1])
    assert torch.equal(a[0], b[0])
    taps = (0, 1, 2, 3)   # the embedding, each layer's input, the last layer's output
    got = []
    for model in (native, python):
        pool = KVPool(model.be, 32, 16, 3, 64, dtype=model.dtype, num_layers=LAYERS)
        got.append(forward_tokens(model, pool, [pool.sequence()], [6], torch.tensor(PROMPT[:6]), all_rows=True,
                                  hidden_rows=torch.arange(6), feature_layers=taps)[1])
    assert got[0].shape == (6, 4 * 576) and torch.equal(got[0], got[1])


def test_a_changed_step_is_seen(twins, monkeypatch):
    """PLANTED: the loop run with eps doubled: the comparison above would fail."""
    native, python = twins
    real = layer_loop.LayerLoop.run
    monkeypatch.setattr(layer_loop.LayerLoop, "run", lambda self, *a, **kw: real(self, *a[:-2], a[-2] * 2, a[-1]))
    assert not torch.equal(_run(native, [[5]])[0], _run(python, [[5]])[0])


def test_bad_arguments_are_refused(twins):
    native, _ = twins
    loop = native.loop
    h = torch.zeros(2, 576)
    with pytest.raises(HalError, match="h: expected a contiguous float32"):
        loop.run(torch.zeros(2, 576, dtype=torch.float64), None, None, [2], [], [], (), 1e-5, 0.125)
    keys = KeyLists(torch.tensor([[0]]), torch.tensor([2]), torch.tensor([0, 2]), 2, 2, None, torch.tensor([0, 1]))
    rot = torch.ones(2, 32, dtype=torch.complex64)
    caches = [torch.zeros(4, 16, 3, 64, dtype=native.dtype) for _ in range(LAYERS)]
    with pytest.raises(HalError, match="widths: expected chunk widths covering 2 rows"):
        loop.run(h, keys, rot, [1], caches, caches, (), 1e-5, 0.125)
    with pytest.raises(HalError, match="rot: expected complex64"):
        loop.run(h, keys, rot[:1], [2], caches, caches, (), 1e-5, 0.125)
    with pytest.raises(HalError, match=r"keys.slot_of: expected contiguous int64 \[2\]"):   # key lists of 1 row
        loop.run(h, KeyLists(torch.tensor([[0]]), torch.tensor([2]), torch.tensor([0, 1]), 1, 1, None,
                                torch.tensor([0])), rot, [2], caches, caches, (), 1e-5, 0.125)
    with pytest.raises(HalError, match="k_caches: expected one per layer"):
        loop.run(h, keys, rot, [2], caches[:2], caches, (), 1e-5, 0.125)
    odd = caches[:2] + [torch.zeros(4, 16, 3, 64, dtype=native.dtype).transpose(1, 2)]
    with pytest.raises(HalError, match="k_caches: expected contiguous host caches"):
        loop.run(h, keys, rot, [2], odd, caches, (), 1e-5, 0.125)
    ok = loop.run(h, keys, rot, [2], caches, caches, (), 1e-5, 0.125)   # the same call, well formed
    assert ok.shape == (2, 0) and torch.isfinite(h).all()   # no taps: no feature columns


def test_the_first_layer_refuses_what_the_checked_write_kv_refuses_and_writes_nothing(twins):
    """Every layer runs in the loop: a repeated slot or one outside the cache is refused
    before any KV is written; the well-formed call then writes both rows' keys."""
    native, _ = twins
    rot = torch.ones(2, 32, dtype=torch.complex64)
    caches = [torch.zeros(4, 16, 3, 64, dtype=native.dtype) for _ in range(2 * LAYERS)]
    def keys(slots):
        return KeyLists(torch.tensor([[0]]), torch.tensor([2]), torch.tensor([0, 2]), 2, 2, None, torch.tensor(slots))
    for slots, match in (([1, 1], "slot_mapping: expected distinct slots"), ([0, 64], "slots|batch")):
        with pytest.raises(HalError, match=match):
            native.loop.run(torch.randn(2, 576), keys(slots), rot, [2], caches[:LAYERS], caches[LAYERS:], (),
                            1e-5, 0.125)
        assert all(not c.any() for c in caches)
    taps = native.loop.run(torch.randn(2, 576), keys([0, 1]), rot, [2], caches[:LAYERS], caches[LAYERS:],
                           (0, LAYERS), 1e-5, 0.125)
    assert taps.shape == (2, 2 * 576) and all(c[0, :2].any(-1).all() and not c[0, 2:].any() for c in caches)


def test_no_cxx_compiler_leaves_the_python_loop(monkeypatch, tmp_path):
    plant_failing_compiler(monkeypatch, tmp_path, "CXX", layer_loop)
    cfg, w = _weights(torch.bfloat16, seed=1)
    with pytest.warns(RuntimeWarning, match="layer loop did not build.*planted failure"):
        model = Llama(cfg, w, hal.get_backend("cpu"), plan=LinearPlan("mm", torch.bfloat16, (1, 2, 4, 8), weights="int4"))
    assert model.loop is None and model.forward is not None
    assert _run(model, [[5]])[0].isfinite().all()


def test_only_weights_packed_as_the_config_says_are_read_natively(twins):
    """The loop reads raw memory in the config's shapes: a weight of another shape, dtype or
    form keeps the model on the Python loop (`layer_loop.applies`)."""
    native, _ = twins
    form, w = native.plan.weights, native.w["0.wo"]
    packed_as = layer_loop._tiled_as if form == "q4q8" else layer_loop._packed_as
    other = torch.float32 if native.dtype == torch.bfloat16 else torch.bfloat16
    assert packed_as(w, 576, 576, native.dtype)
    assert not packed_as(w, 592, 576, native.dtype) and not packed_as(w, 576, 576, other)
    assert not (layer_loop._packed_as if form == "q4q8" else layer_loop._tiled_as)(w, 576, 576, native.dtype)
    cfg, weights = _weights(native.dtype, seed=2, form=form)
    g = torch.Generator().manual_seed(3)
    weights["1.wdown"] = q4_rows.pack(q4_rows.random(576, 1504, g), native.dtype) if form == "q4q8" else \
        int4.random(576, 1504, g).pack(native.dtype)   # K != ffn
    plan = LinearPlan("mm", native.dtype, (1, 2, 4, 8), weights=form)
    assert not layer_loop.applies(Llama(cfg, weights, native.be, plan=plan, native_loop=False))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.integers(1, 12), min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_drawn_ragged_batches_give_the_python_loops_bits(twins, lens, seed):
    """Hypothesis-drawn batches (1-3 requests after their prompts, 1-12 fed tokens each, so
    rows span several padded chunks): the native loop's logits and caches are the Python loop's."""
    native, python = twins
    g = torch.Generator().manual_seed(seed)
    feeds = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    results = []
    for model in (native, python):
        pool = KVPool(model.be, 48, 16, 3, 64, dtype=model.dtype, num_layers=LAYERS)
        seqs = [pool.sequence() for _ in feeds]
        for n, s in enumerate(seqs):
            prompt = PROMPT[:5 + 7 * n]
            forward(model, pool, [s], [prompt], False)
            s.commit(len(prompt))
        logits, _ = forward(model, pool, seqs, feeds, True)
        results.append((logits, pool.k, pool.v))
    (la, ka, va), (lb, kb, vb) = results
    assert torch.equal(la, lb)
    assert all(torch.equal(x, y) for x, y in zip(ka + va, kb + vb))
