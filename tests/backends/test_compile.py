"""One decode step of the engine (sample -> verify -> KV write) through the cpu backend's
checked ops compiles with ``torch.compile(fullgraph=True)``: zero graph breaks (the ops
are custom ops; value checks stand aside while tracing), and the compiled step equals
eager, KV cache writes included."""

import pytest
import torch

import hal

R, K, V, H, D, BS, NB = 3, 4, 32, 2, 8, 4, 8


def step(be, logits, draft_ids, cu, temperature, top_k, top_p, seeds, offsets, key, value, kc, vc, slots):
    out, n_acc = be.verify_greedy(draft_ids, cu, logits, K)                     # the accepted prefix + 1
    bonus, q = be.sample(logits, temperature, top_k, top_p, seeds, offsets)     # a sampled row per fed token
    p = be.verify_rejection(draft_ids, cu, None, q, seeds[:R], offsets[:R], K)  # the same drafts, sampled
    be.write_kv(key, value, kc, vc, slots)                                      # the fed tokens' KV
    return out, n_acc, bonus, p[0], p[1]


def inputs():
    g = torch.Generator().manual_seed(0)
    counts = [4, 2, 3]
    T = sum(counts) + R
    cu = torch.tensor([0, *counts]).cumsum(0)
    logits = torch.randn(T, V, generator=g) * 3
    draft_ids = torch.randint(0, V, (sum(counts),), generator=g)
    temperature = torch.tensor([0.0, 0.7, 1.0] * (T // 3) + [0.5] * (T % 3))
    return (logits, draft_ids, cu, temperature, torch.zeros(T, dtype=torch.int32), torch.ones(T),
            torch.arange(T), torch.zeros(T, dtype=torch.long), torch.randn(T, H, D, generator=g),
            torch.randn(T, H, D, generator=g), torch.zeros(NB, BS, H, D), torch.zeros(NB, BS, H, D),
            torch.randperm(NB * BS, generator=g)[:T])


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_decode_step_compiles_without_graph_breaks(backend):
    be = hal.get_backend("cpu")
    torch._dynamo.reset()
    args = inputs()
    explain = torch._dynamo.explain(lambda *a: step(be, *a))(*args)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    eager_args, compiled_args = inputs(), inputs()
    want = step(be, *eager_args)
    got = torch.compile(lambda *a: step(be, *a), fullgraph=True, backend=backend)(*compiled_args)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert torch.equal(eager_args[-3], compiled_args[-3]) and torch.equal(eager_args[-2], compiled_args[-2])
    assert compiled_args[-3].abs().sum() > 0   # the KV write happened inside the compiled graph


def test_value_checks_still_run_eagerly():
    be = hal.get_backend("cpu")
    args = list(inputs())
    args[1] = args[1].clone()
    args[1][0] = V + 5   # a draft token id out of range
    with pytest.raises(hal.HalError, match="draft_token_ids"):
        step(be, *args)
