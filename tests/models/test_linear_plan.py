"""The linear plan chooser (`hal.models.linear_plan`): only batch-invariant layouts are ever
chosen, the fastest of them wins, and a cached plan is used only under the CPU signature it
was measured for."""

import json

import pytest
import torch

import hal
from hal.models.linear_layout import LAYOUTS, LinearPlan
from hal.models.linear_plan import choose_plan
from hal.models.plan_check import usable_groups
from hal.models.machine import cpu_signature

SHAPES = [(96, 64), (64, 64), (192, 64), (64, 96), (500, 64)]


def mixing(x, w):     # PLANTED: nearly free, and every row depends on its batch-mates
    return torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype) + x.sum(0)[0]


def rowwise(x, w):    # PLANTED: nearly free, and each row depends on itself only
    return torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype) + x[:, :1]


@pytest.fixture
def planted_is_fastest(monkeypatch):
    """Timing is not what these tests check: a planted layout measures 1 ms, the others 100."""
    import hal.models.linear_plan as lp
    monkeypatch.setattr(lp, "time_plan", lambda plan, weights, rows=lp.REPORT_ROWS, reps=3: {
        m: 1.0 if plan.layout == "planted" else 100.0 for m in rows})


def test_a_fast_layout_that_is_not_invariant_is_never_chosen(planted_is_fastest):
    choice = choose_plan(SHAPES, "float32", layouts={"mm": LAYOUTS["mm"], "planted": mixing}, cache=False)
    assert any("planted" in why for why in choice.rejected), choice.rejected
    # alone in a chunk of one a row has no mates: only that width may survive
    assert all(c["plan"]["widths"] == [1] for c in choice.candidates if c["plan"]["layout"] == "planted")
    assert choice.plan.layout == "mm" or choice.plan.widths == (1,), choice.plan


def test_the_fastest_invariant_layout_wins(planted_is_fastest):
    """The teeth of the test above: an invariant planted layout, as fast, is chosen."""
    choice = choose_plan(SHAPES, "float32", layouts={"mm": LAYOUTS["mm"], "planted": rowwise}, cache=False)
    assert choice.plan.layout == "planted", choice.candidates
    assert choice.plan.widths == (1, 2, 4, 8, 16)


def test_widths_are_grouped_by_the_bits_they_give():
    groups, why = usable_groups(LAYOUTS["mm"], torch.float32, SHAPES)
    dropped = {int(w.split()[1]) for w in why}
    assert sorted([n for g in groups for n in g] + sorted(dropped)) == [1, 2, 4, 8, 16], (groups, why)
    for group in groups:   # inside a group every width gives a row the same bits
        plan = LinearPlan("mm", torch.float32, group)
        w = torch.randn(96, 64)
        x = torch.randn(1, 64)
        ref = plan.linear(x, w)[0]
        for m in group:
            batch = torch.randn(m, 64)
            batch[0] = x[0]
            assert torch.equal(LAYOUTS["mm"](batch, w)[0], ref), (group, m)


def test_a_cached_plan_is_used_only_under_its_signature(tmp_path, monkeypatch):
    """Timings are fixed here (a busy machine makes a measurement noisy, and a noisy one is not
    cached: the test above); this test is about the signature alone."""
    import hal.models.linear_plan as lp
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    monkeypatch.setattr(lp, "time_plan", lambda plan, weights, rows=lp.REPORT_ROWS, reps=3: {m: float(m) for m in rows})
    first = choose_plan(SHAPES, "float32")
    assert not first.from_cache
    assert choose_plan(SHAPES, "float32").from_cache
    (path,) = (tmp_path / "plans").glob("linear-*.json")
    saved = json.loads(path.read_text())
    planted = {"layout": "mm", "dtype": "float32", "widths": [3]}
    path.write_text(json.dumps({**saved, "plan": planted}))
    assert not choose_plan(SHAPES, "float32").from_cache               # cached without its chunks' costs: again
    planted["costs"] = [3.0]
    path.write_text(json.dumps({**saved, "plan": planted}))
    assert choose_plan(SHAPES, "float32").plan.widths == (3,)           # the same signature: trusted as cached
    path.write_text(json.dumps({**saved, "plan": planted, "signature": {**saved["signature"], "cpu": "another CPU"}}))
    again = choose_plan(SHAPES, "float32")
    assert not again.from_cache and again.plan.widths != (3,), "a plan cached for another CPU was used"
    assert json.loads(path.read_text())["signature"] == cpu_signature()
    assert choose_plan(SHAPES, "float32", refresh=True).from_cache is False


def test_bad_dtype_is_refused_by_name():
    with pytest.raises(hal.HalError, match="dtype: expected one of auto, stored, float32, bfloat16"):
        choose_plan(SHAPES, "float16", cache=False)


def test_a_noisy_measurement_is_repeated_then_not_cached(tmp_path, monkeypatch):
    """The outside trial: a plan measured on a busy machine was cached for good. The winner is
    timed twice; when its two scores differ by more than NOISE the whole measurement runs
    again, and if it is still noisy the plan is used but not cached, and says so. A quiet
    measurement is cached with when, at what load and with what spread it was measured."""
    import hal.models.linear_layout as linear_layout
    import hal.models.linear_plan as lp
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    calls = []

    def noisy(plan, weights, rows=lp.REPORT_ROWS, reps=3):   # PLANTED: every other plan timing 10x slower
        if rows != lp.SCORE_ROWS:   # a single width's chunk (`single_chunks`)
            return {m: 1.0 for m in rows}
        calls.append(plan.layout)
        return {m: 1.0 if len(calls) % 2 else 10.0 for m in rows}
    monkeypatch.setattr(lp, "time_plan", noisy)
    choice = choose_plan(SHAPES, "float32", layouts={"planted": rowwise}, cache=True)
    assert choice.noisy and "noisy" in choice.conditions() and "not cached" in choice.summary()
    assert len(calls) == 4, calls   # measured, checked, measured again, checked again
    assert not (tmp_path / "plans").exists() or not list((tmp_path / "plans").glob("*.json"))

    monkeypatch.setattr(lp, "time_plan", lambda plan, weights, rows=lp.REPORT_ROWS, reps=3: {m: 1.0 for m in rows})
    planted = {"planted": rowwise}   # the cache is for the default layouts only: plant them where plans read them
    monkeypatch.setattr(lp, "LAYOUTS", planted)
    monkeypatch.setattr(linear_layout, "LAYOUTS", planted)
    quiet = choose_plan(SHAPES, "float32")
    assert not quiet.noisy and quiet.measured["spread"] == 0.0 and quiet.measured["load"] >= 0
    cached = choose_plan(SHAPES, "float32")
    assert cached.from_cache and cached.measured == quiet.measured and "at load" in cached.conditions()


def test_a_candidate_far_slower_by_its_single_chunks_is_not_timed_further(monkeypatch):
    """A cold plan times at the `MIX` rows only the candidates predicted within `PRUNE` of the
    best; the others keep their predicted score and are never chosen."""
    import hal.models.linear_plan as lp
    timed = []

    def planted(plan, weights, rows=lp.REPORT_ROWS, reps=3):   # PLANTED: "slow" costs 10x per chunk
        if rows == lp.SCORE_ROWS:
            timed.append(plan.layout)
        return {m: (10.0 if plan.layout == "slow" else 1.0) * len(lp.chunks(plan.widths, m)) for m in rows}
    monkeypatch.setattr(lp, "time_plan", planted)
    choice = choose_plan(SHAPES, "float32", layouts={"mm": LAYOUTS["mm"], "slow": rowwise}, cache=False)
    assert "slow" not in timed and "mm" in timed, timed
    slow = [c for c in choice.candidates if c["plan"]["layout"] == "slow"]
    assert slow and all(c.get("predicted") and not c["ms"] for c in slow), slow
    assert choice.plan.layout == "mm"


def test_a_second_process_waits_for_the_first_ones_measurement_and_reads_it(tmp_path, monkeypatch):
    """Two processes loading one model (a target and its draft rank): while one holds the
    measuring lock the other waits, then reads what it cached, and never times anything."""
    import fcntl
    import threading

    import hal.models.linear_plan as lp
    from hal.models import plan_cache
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    monkeypatch.setattr(lp, "time_plan", lambda plan, weights, rows=lp.REPORT_ROWS, reps=3: {m: 1.0 for m in rows})
    first = choose_plan(SHAPES, "float32")          # what "the other process" will have cached
    (path,) = (tmp_path / "plans").glob("linear-*.json")
    saved = path.read_text()
    path.unlink()
    timed, waiting, real_flock = [], threading.Event(), fcntl.flock

    def flock(f, op):
        if op == fcntl.LOCK_EX:
            waiting.set()
        return real_flock(f, op)
    monkeypatch.setattr(plan_cache.fcntl, "flock", flock)
    monkeypatch.setattr(lp, "time_plan", lambda *a, **k: timed.append(1) or {m: 1.0 for m in lp.REPORT_ROWS})
    got = []
    with open(path.with_suffix(".lock"), "a") as held:
        real_flock(held, fcntl.LOCK_EX)              # the other process is measuring
        t = threading.Thread(target=lambda: got.append(choose_plan(SHAPES, "float32")))
        t.start()
        assert waiting.wait(60), "choose_plan never asked for the lock"
        path.write_text(saved)                       # the other process cached its plan
        real_flock(held, fcntl.LOCK_UN)
    t.join(60)
    assert got and got[0].from_cache and got[0].plan == first.plan and not timed, (got, timed)
