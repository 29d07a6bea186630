"""Placement parsing/resolution, draft transfers (sparse q is exact), and the memory
planner: its accounting, its refusals, and allocation only after it passes."""

import os

import pytest
import torch

import hal
from hal.conformance._helpers import ragged, seeds_offsets
from hal.devices import dense_q, sparse_q, transfer
from hal.distributed.placement import Placement, resolve_side
from hal.engine.memory import GiB, ModelMemory, plan_memory

SMOL = ModelMemory("smollm2-135m", 270_000_000, 30, 3, 64, 576, 1536, 49152)


def test_placement_from_env_and_errors():
    p = Placement.from_env("draft=cpu, target=cuda:0")
    assert (p.draft, p.target) == ("cpu", "cuda:0")
    assert Placement.from_env("") == Placement("auto", "auto")
    for bad in ("draft:cpu", "drafter=cpu", "target=", "draft=cpu,target"):
        with pytest.raises(hal.HalError, match="HAL_PLACEMENT"):
            Placement.from_env(bad)
    with pytest.raises(hal.HalError, match="draft: expected an available backend or device type, got 'tpu:0'"):
        Placement("tpu:0", "cpu").resolve()
    with pytest.raises(hal.HalError, match="target"):
        Placement("cpu", "cpu:x").resolve()


def test_sides_resolve_through_the_registry(monkeypatch):
    draft, target = Placement("cpu", "cpu").resolve()
    assert draft.backend.name == target.backend.name == "cpu" and target.device == torch.device("cpu")
    if os.environ.get("HAL_ASCEND_EMULATE") == "1":   # the device type "npu" is served by the ascend backend
        assert resolve_side("npu:0").backend.name == "ascend"
    if os.environ.get("TRITON_INTERPRET") != "1":      # an explicit unavailable device never falls back
        with pytest.raises(hal.HalError, match="cuda"):
            resolve_side("cuda:0", "target")


def test_sparse_q_is_exact_through_verification():
    be = hal.get_backend("cpu")
    g = torch.Generator().manual_seed(0)
    V, drafts = 50, [[3, 7], [1, 2, 4]]
    logits = torch.randn(5, V, generator=g)
    # top-k 4 draft probabilities, with a tie at the cutoff kept (5 non-zeros in row 0)
    q = torch.softmax(logits, -1) * (logits >= logits.topk(4, -1).values[:, -1:])
    q[0, 40] = q[0][q[0] > 0].min()
    q = q / q.sum(-1, keepdim=True)
    idx, vals = sparse_q(q)
    assert idx.shape == (5, 5) and idx.dtype == torch.int32
    assert torch.equal(dense_q(idx, vals, V), q)
    p = torch.softmax(torch.randn(7, V, generator=g), -1)
    ids, cu = ragged(drafts)
    s, o = seeds_offsets(2)
    a = be.verify_rejection(ids, cu, q, p, s, o, 3)
    b = be.verify_rejection(ids, cu, dense_q(*sparse_q(q), V), p, s, o, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(hal.HalError, match="q: expected a \\[N, V\\] tensor"):
        sparse_q(q[0])


def test_transfer_same_device_is_free():
    t = torch.arange(4)
    assert transfer(t, torch.device("cpu")) is t


def test_plan_accounts_for_weights_kv_and_headroom():
    cpu = resolve_side("cpu")
    plan = plan_memory(SMOL, cpu, SMOL, cpu, max_seqs=8, max_context=2048, budget_bytes={"cpu": 4 * GiB}, fill=True)
    d = plan.devices["cpu"]
    assert d.weights == 2 * SMOL.weight_bytes and d.total <= d.budget
    per_token = 2 * 30 * 3 * 64 * 4
    assert plan.pools["target"].block_bytes == 16 * per_token
    assert plan.capacity["target"] >= 8 and plan.pools["target"].num_blocks % (-(-(2048 + 9) // 16)) == 0
    assert "max concurrent sequences x context" in plan.report()
    exact = plan_memory(SMOL, cpu, max_seqs=2, max_context=100, budget_bytes={"cpu": 4 * GiB})
    assert exact.pools["target"].num_blocks == 2 * 7 and exact.capacity["target"] > 2   # ceil(109 / 16) = 7
    pool = plan.allocate("target")  # allocation happens only here, after the plan passed
    assert pool.k[0].shape == (plan.pools["target"].num_blocks, 16, 3, 64) and len(pool.k) == 30


def test_a_feature_drafters_cached_rows_are_planned_with_the_target_kv():
    """With a drafter that reads the target's features and prefix caching on, each target position
    also keeps its feature rows (`hal.engine.feature_cache`): the plan counts them, so the same
    budget holds fewer blocks, and the report says so; the start-up computes the bytes from the
    drafter's taps without loading it."""
    from dataclasses import replace
    from types import SimpleNamespace
    from hal.drafters.kinds import parse_draft
    from hal.launch.start import _feature_bytes
    from hal.models.loaders import read_config
    from hal.models.fetch import fetch
    cpu = resolve_side("cpu")
    feats = replace(SMOL, feature_bytes=3 * 576 * 4)
    a, b = (plan_memory(m, cpu, max_seqs=4, max_context=1024, budget_bytes={"cpu": 2 * GiB}, fill=True)
            for m in (SMOL, feats))
    kv = 2 * 30 * 3 * 64 * 4
    assert b.pools["target"].block_bytes == 16 * (kv + 3 * 576 * 4) and b.devices["cpu"].total <= 2 * GiB
    assert b.pools["target"].num_blocks < a.pools["target"].num_blocks
    assert "with their cached target features" in b.report() and "features" not in a.report()
    cfg = read_config(fetch("smollm2-135m"))
    args = lambda caching: SimpleNamespace(model="smollm2-135m", enable_prefix_caching=caching)  # noqa: E731
    assert _feature_bytes(args(None), parse_draft("dspark"), cfg) == 3 * 576 * 4   # taps 1/16/29
    assert _feature_bytes(args(None), parse_draft("eagle"), cfg) == 3 * 576 * 4    # EAGLE-3: taps 2/15/27
    assert _feature_bytes(args(False), parse_draft("eagle"), cfg) == 0
    assert _feature_bytes(args(None), parse_draft("ngram"), cfg) == 0


def test_plan_refusals_say_what_to_change():
    cpu = resolve_side("cpu")
    with pytest.raises(hal.HalError, match=r"expected a budget in bytes \(budget_bytes=\{'cpu': \.\.\.\}\)"):
        plan_memory(SMOL, cpu, max_seqs=1, max_context=128)
    with pytest.raises(hal.HalError, match="exceed the budget.*move the draft to another device"):
        plan_memory(SMOL, cpu, SMOL, cpu, max_seqs=1, max_context=128, budget_bytes={"cpu": 400 << 20})
    with pytest.raises(hal.HalError, match=r"max_seqs=64 x max_context=8192.*got room for (\d+) sequences; "
                                           r"lower max_seqs to \1, or max_context to about \d+"):
        plan_memory(SMOL, cpu, max_seqs=64, max_context=8192, budget_bytes={"cpu": 2 * GiB})
    with pytest.raises(hal.HalError, match=r"block_size\['target'\]: expected powers of two"):
        plan_memory(SMOL, cpu, max_seqs=1, max_context=128, budget_bytes={"cpu": GiB}, block_size={"target": 24})
    with pytest.raises(hal.HalError, match="max_context: expected an int >= 1, got 0"):
        plan_memory(SMOL, cpu, max_seqs=1, max_context=0, budget_bytes={"cpu": GiB})


@pytest.mark.skipif(os.environ.get("HAL_ASCEND_EMULATE") != "1", reason="needs HAL_ASCEND_EMULATE=1")
def test_plan_uses_each_backends_alignment():
    npu = resolve_side("npu:0")
    plan = plan_memory(SMOL, npu, max_seqs=2, max_context=1000, budget_bytes={"cpu": GiB})
    assert plan.pools["target"].block_size == 128                    # ascend: multiples of 128
    assert plan.pools["target"].num_blocks % 8 == 0                   # ceil((1000 + 9) / 128) = 8 per sequence
    odd = ModelMemory("odd", 1000, 2, 2, 72, 144, 256, 100)
    with pytest.raises(hal.HalError, match="head_dim: expected a multiple of 16 for backend ascend, got 72"):
        plan_memory(odd, npu, max_seqs=1, max_context=16, budget_bytes={"cpu": GiB})
