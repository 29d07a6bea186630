"""int4 weights as stored (`hal.models.int4`): GGUF's Q4_0/Q4_1 blocks read exactly as the
gguf package dequantizes them, multiplied by the int4pack kernel, and chosen by the linear
plan only where the kernel is batch-invariant. The plan's q4q8 form (`hal.models.q4_rows`,
its own tests) is made unavailable here, so every plan measured is of int4pack's family.

Tolerances: float32 rows against float32 ``x @ W.T`` of the dequantized weights, 1e-5
relative to the largest output (accumulation order only); bfloat16 rows, 2e-2 (bfloat16
rows, scales and zeros: 8 bits of mantissa)."""

import time

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from hal.errors import HalError
from hal.models import int4, q4_rows
from hal.models import linear_plan as lp
from hal.models import plan_check
from hal.models.linear_layout import LAYOUTS, LinearPlan
from hal.models.linear_plan import choose_plan
from hal.models.llama import Llama, random_llama

KINDS = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}


@pytest.fixture(autouse=True)
def int4pack_only(monkeypatch):
    monkeypatch.setattr(q4_rows, "available", lambda: False)


def stored(kind: str, N: int, K: int, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    raw = quants.quantize(x, KINDS[kind])
    return raw, torch.from_numpy(quants.dequantize(raw, KINDS[kind]).reshape(N, K).copy())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_blocks_read_exactly_as_gguf_dequantizes_them(kind):
    raw, ref = stored(kind, 48, 96)
    blocks = int4.from_blocks(raw, kind, (48, 96))
    assert torch.equal(blocks.dequantize(), ref)
    assert int(blocks.codes.max()) <= 15


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_kernel_multiplies_the_stored_weights(kind):
    raw, ref_w = stored(kind, 64, 128, seed=1)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    ref = x @ ref_w.T
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        w = int4.from_blocks(raw, kind, (64, 128)).pack(dtype)
        got = w.mm(x.to(dtype)).float()
        assert (got - ref).abs().max() <= tol * ref.abs().max(), (kind, dtype)


def test_fused_projections_equal_their_parts():
    parts = [int4.from_blocks(stored("Q4_1", n, 64, seed=n)[0], "Q4_1", (n, 64)) for n in (32, 16, 16)]
    fused = int4.cat(parts).pack(torch.float32)
    x = torch.randn(3, 64)
    each = torch.cat([p.pack(torch.float32).mm(x) for p in parts], 1)
    assert torch.equal(fused.mm(x), each)


def test_bad_blocks_are_refused_naming_the_argument():
    raw, _ = stored("Q4_1", 16, 64)
    with pytest.raises(HalError, match="raw"):
        int4.from_blocks(raw[:, :-1], "Q4_1", (16, 64))
    with pytest.raises(HalError, match="kind"):
        int4.from_blocks(raw, "Q5_1", (16, 64))
    with pytest.raises(HalError, match="weight: expected int4 codes .N, K. with N a multiple of 16"):
        int4.from_blocks(stored("Q4_1", 8, 64)[0], "Q4_1", (8, 64))
    with pytest.raises(HalError, match="cpu"):
        int4.from_blocks(raw, "Q4_1", (16, 64)).pack(torch.float32).to("meta")


def test_q8_0_blocks_run_as_two_int4_halves_exactly():
    """A Q8_0 head as stored: the halves dequantize to exactly what gguf reads, and the
    kernel multiplies ``[x | x]`` by them as ``x @ W.T`` (float32 rows 1e-5, bfloat16 2e-2)."""
    x = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32) * 0.05
    raw = quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    ref_w = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(64, 128).copy())
    halves = int4.from_q8_0(raw, (64, 128))
    deq = halves.dequantize()
    assert torch.equal(deq[:, :128] + deq[:, 128:], ref_w)   # 16·hi·d + lo·d: each exact in float32
    rows = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    ref = rows @ ref_w.T
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        w = halves.pack(dtype, repeat=2)
        assert w.shape == (64, 128) and w.repeat == 2
        assert (w.mm(rows.to(dtype)).float() - ref).abs().max() <= tol * ref.abs().max(), dtype
    with pytest.raises(HalError, match=r"raw: expected 8704 bytes for Q8_0 \[64, 128\], got 8640"):
        int4.from_q8_0(raw[:, :-1], (64, 128))
    with pytest.raises(HalError, match="repeat"):
        halves.pack(torch.float32, repeat=3)


SHAPES = [(96, 64), (64, 64), (500, 64)]
INT4 = [True, True, False]
HALVES = (SHAPES[-1][0] - 4, 2 * SHAPES[-1][1])   # a Q8_0 head's halves (N a multiple of 16)
HEAD_SHAPES = SHAPES[:-1] + [(HALVES[0], SHAPES[-1][1])]


def test_a_q8_0_head_runs_as_stored_where_it_times_faster():
    """An int4 plan with ``q8_head`` times the head's two forms interleaved at the plan's
    widths and keeps the lower score; both are in the choice for ``hal info``."""
    choice = choose_plan(HEAD_SHAPES, "stored", stored_int4=INT4, cache=False, q8_head=True)
    forms = {h["head"]: h["score"] for h in choice.heads}
    assert set(forms) == {"float", "q8_0"}, choice.heads
    assert choice.plan.head == min(forms, key=forms.get)
    assert choice.plan.describe().count("lm_head Q8_0") == (choice.plan.head == "q8_0")
    assert LinearPlan.from_json(choice.plan.to_json()) == choice.plan
    assert choose_plan(HEAD_SHAPES, "stored", stored_int4=INT4, cache=False).heads == []   # not asked: not timed


def test_a_q8_0_head_whose_rows_mix_is_never_chosen(monkeypatch):
    """The head's own self-check: a planted kernel whose rows depend on their batch-mates on
    the halves' shape only leaves the float head, and says why."""
    real = plan_check.int4_mm
    def mixing(x, w):     # PLANTED: the halves' product plus a term from every row
        out = real(x, w)
        return out + x.float().sum(0, keepdim=True)[:, :1] * 1e-2 if tuple(w.shape) == HALVES else out
    monkeypatch.setattr(plan_check, "int4_mm", mixing)
    choice = choose_plan(HEAD_SHAPES, "stored", stored_int4=INT4, cache=False, q8_head=True)
    assert choice.plan.weights == "int4" and choice.plan.head == "float" and choice.heads == []
    assert any(why.startswith("bfloat16 q8_0 head: not invariant") for why in choice.rejected), choice.rejected


def test_a_slower_q8_0_head_is_not_chosen(monkeypatch):
    """The choice follows the timing: halves planted 50 ms slower per call keep the float head."""
    real = int4.Int4Weight.mm
    def slow(self, x):    # PLANTED: the halves cost 50 ms more per call
        if self.repeat > 1:
            time.sleep(0.05)
        return real(self, x)
    monkeypatch.setattr(int4.Int4Weight, "mm", slow)
    choice = choose_plan(HEAD_SHAPES, "stored", stored_int4=INT4, cache=False, q8_head=True, reps=1)
    assert choice.plan.head == "float", choice.heads
    assert {h["head"]: h["score"] for h in choice.heads}["q8_0"] >= 50


def test_a_pinned_head_form_is_kept_or_refused_naming_the_flag(monkeypatch, tmp_path):
    """``--lm-head``: ``float`` always applies; ``stored`` only over an int4 plan whose Q8_0 head
    passed the self-check (a pin skips the timing, never the check), else a `HalError` naming
    the flag and what is missing."""
    from hal.models.fetch import load_model
    choice = choose_plan(HEAD_SHAPES, "stored", stored_int4=INT4, cache=False, q8_head=True)
    assert lp.pin_head(choice, "auto") == choice.plan
    assert lp.pin_head(choice, "float").head == "float" and lp.pin_head(choice, "stored").head == "q8_0"
    assert lp.pin_head(choice, "stored").widths == choice.plan.widths
    floats = choose_plan(HEAD_SHAPES, "float32", stored_int4=INT4, cache=False, q8_head=True)
    unasked = choose_plan(HEAD_SHAPES, "stored", stored_int4=INT4, cache=False)   # the file's head is not Q8_0
    real = plan_check.int4_mm
    monkeypatch.setattr(plan_check, "int4_mm", lambda x, w: (   # PLANTED: the halves' rows mix
        real(x, w) + x.float().sum(0, keepdim=True)[:, :1] * 1e-2 if tuple(w.shape) == HALVES else real(x, w)))
    mixing = choose_plan(HEAD_SHAPES, "stored", stored_int4=INT4, cache=False, q8_head=True)
    for bad, why in ((floats, "expected an int4 plan"), (unasked, "not stored as Q8_0"), (mixing, "not invariant")):
        with pytest.raises(HalError, match=why) as e:
            lp.pin_head(bad, "stored")
        assert e.value.arg == "--lm-head"
        assert lp.pin_head(bad, "float").head == "float"
    with pytest.raises(HalError, match="expected one of auto, stored, float, got 'q8'"):
        lp.pin_head(choice, "q8")
    with pytest.raises(HalError, match="expected auto or float for an HF folder"):   # refused before loading
        load_model(str(tmp_path), None, lm_head="stored")


def test_a_q8_0_head_needs_an_int4_plan_and_its_packed_head():
    with pytest.raises(HalError, match="q8_0 only with int4"):
        LinearPlan.from_json({"layout": "mm", "dtype": "float32", "widths": [1], "weights": "float", "head": "q8_0"})
    model = random_llama(64, 1, 4, 2, 16, 64, 96, seed=0, scale=0.05)
    plan = LinearPlan("mm", torch.bfloat16, (1,), weights="int4", head="q8_0")
    with pytest.raises(HalError, match=r"weights\['head_stored'\]: expected the lm_head's stored codes"):
        Llama(model.cfg, dict(model.w), model.be, plan=plan)


def test_stored_runs_the_int4_shapes_as_stored_and_the_rest_as_float():
    choice = choose_plan(SHAPES, "stored", stored_int4=INT4, cache=False)
    plan = choice.plan
    assert plan.weights == "int4" and all(c["plan"]["weights"] == "int4" for c in choice.candidates)
    # bf16 rows on every CPU (no flag decides it); float32 rows only where bf16 gives no usable group
    assert plan.dtype == torch.bfloat16
    assert f"float32 int4: not measured ({lp.FALLBACK_ONLY})" in choice.rejected
    g = torch.Generator().manual_seed(3)
    w4, wf = int4.random(96, 64, g), torch.randn(500, 64, generator=g)
    x = torch.randn(7, 64, generator=g)
    packed = w4.pack(plan.dtype)
    # each row as if alone: the same bits in a batch of 7 as in a chunk of one
    alone = torch.cat([plan.linear(x[i:i + 1], packed) for i in range(7)])
    assert torch.equal(plan.linear(x, packed), alone)
    assert torch.equal(plan.linear(x, wf.to(plan.dtype)),
                       torch.cat([plan.linear(x[i:i + 1], wf.to(plan.dtype)) for i in range(7)]))


def test_an_int4_kernel_that_mixes_rows_is_never_chosen(monkeypatch):
    """The teeth of the self-check: a planted int4 kernel whose rows depend on their batch-mates."""
    def mixing(x, w):     # PLANTED: the true product plus a term from every row
        return w.mm(x) + x.sum(0, keepdim=True)[:, :1] * 1e-2
    monkeypatch.setattr(plan_check, "int4_mm", mixing)
    choice = choose_plan(SHAPES, "auto", stored_int4=INT4, cache=False, layouts={"mm": LAYOUTS["mm"]})
    assert any("on int4 [" in why for why in choice.rejected), choice.rejected
    assert all(c["plan"]["weights"] == "float" or c["plan"]["widths"] == [1] for c in choice.candidates)


def test_float32_rows_are_measured_only_where_bf16_rows_give_no_usable_int4_plan(monkeypatch):
    """The int4 family falls back to float32 rows, and only then: a planted kernel whose bf16
    rows change from one call to the next (no width usable) leaves float32 rows to be measured."""
    real = plan_check.int4_mm
    def noisy_bf16(x, w):   # PLANTED: bf16 rows get a fresh random term each call
        out = real(x, w)
        return out + torch.rand_like(out) * 1e-2 if x.dtype == torch.bfloat16 else out
    monkeypatch.setattr(plan_check, "int4_mm", noisy_bf16)
    choice = choose_plan(SHAPES, "stored", stored_int4=INT4, cache=False)
    assert choice.plan.weights == "int4" and choice.plan.dtype == torch.float32, choice.plan
    assert any(why.startswith("bfloat16 int4 mm: ") for why in choice.rejected), choice.rejected
    assert not any("not measured" in why for why in choice.rejected)


def test_stored_without_int4_weights_is_refused():
    with pytest.raises(HalError, match="dtype"):
        choose_plan(SHAPES, "stored", stored_int4=[False] * 3, cache=False)
    with pytest.raises(HalError, match="dtype"):
        choose_plan(SHAPES, "int8", cache=False)


def test_a_subset_of_a_width_group_is_chosen_by_its_predicted_time(monkeypatch):
    """Widths of one group give a row the same bits; the plan keeps the subset that costs least."""
    cost = {1: 2.0, 2: 5.0, 4: 20.0, 8: 8.0, 16: 100.0}     # ms of one chunk of each width (planted)
    monkeypatch.setattr(lp, "time_plan", lambda plan, weights, rows=lp.REPORT_ROWS, reps=3: {
        m: sum(cost[n] for n in lp.chunks(plan.widths, m)) for m in rows})
    plan = lp.fastest_subset(LinearPlan("mm", torch.float32, (1, 2, 4, 8, 16)), [])
    # 1 row: one chunk of 1; 5 rows: one of 8 (8 ms) beats 4 + 1 (22) and five of 1 (10); 9 rows: 8 + 1
    assert [lp.chunks(plan.widths, m, plan.costs) for m in (1, 5, 9)] == [[1], [8], [8, 1]], plan
    assert plan.costs == tuple(cost[n] for n in plan.widths)   # what the rows are chunked by at run time
    assert lp.fastest_subset(LinearPlan("mm", torch.float32, (1, 2, 4, 8, 16)), []).widths == plan.widths


def test_a_float_plan_is_one_plan_however_the_file_stores_the_weights(tmp_path, monkeypatch):
    """float32/bfloat16 never run int4 candidates, so the storage mask is not part of their
    key: the target (its file's mask) and a draft model built on its float weights (no mask)
    share one measurement."""
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    monkeypatch.setattr(lp, "time_plan", lambda plan, weights, rows=lp.REPORT_ROWS, reps=3: {m: float(m) for m in rows})
    assert not choose_plan(SHAPES, "float32", stored_int4=INT4).from_cache
    assert choose_plan(SHAPES, "float32").from_cache
    assert not choose_plan(SHAPES, "auto", stored_int4=INT4).from_cache   # auto measures int4 too: its own key
    assert not choose_plan(SHAPES, "auto").from_cache
