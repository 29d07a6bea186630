"""Linear layouts measured on the machine that runs them: how the batch-invariant runner
computes ``x @ W.T``, chosen here (the plan itself, as data: `hal.models.linear_layout`).

A `LinearPlan` is a layout (``mm``: ``mm(W, X.T).T``; ``linear``: ``F.linear(X, W)``), a
dtype for the weights and the multiplied rows (float32, or bfloat16 where the CPU has
AVX512-BF16 or AMX), and the chunk widths: every row is computed inside a chunk of exactly
one of those widths (zero-padded), so its bits never depend on how many rows came with it.

Weights the file stores as Q4_0/Q4_1 blocks can also run **as stored**: ``weights="int4"``,
PyTorch's int4pack kernel (`hal.models.int4`; rows in bfloat16 on every CPU, float32 rows
measured only where bfloat16 gives no usable group), or ``weights="q4q8"``, the same codes (and
Q8_0 layers' codes) times rows quantized to int8 per 32 (`hal.models.q4_rows`, llama.cpp's
arithmetic; where its C++ kernel builds). The other weights run in the plan's float layout and
dtype. ``auto`` measures these candidates with the float ones; ``stored`` only them. An lm_head stored
as Q8_0 (SmolLM2's tied embedding) can run as stored too (``head="q8_0"``: int4's two halves,
or q4q8's Q8 tiles): once such a plan has won, the head's two forms are self-checked at its
widths and timed at the `MIX` rows, and the faster is kept (`_choose_head`).

`choose_plan` picks one at model load:

1. **Usable** candidates only (`hal.models.plan_check`). For each layout and dtype, each probe width is run with a row
   in several positions among random batch-mates, on every weight shape of the model; a width
   whose row changes with its mates or position is dropped, and the remaining widths are
   grouped by the bits they give (widths in one group agree with each other exactly). Each
   group is a candidate plan, with the subset of its widths predicted fastest
   (`fastest_subset`: any subset of a group is as invariant as the group).
2. The **fastest** usable candidate by the measured time of all the model's linears at a mix
   of rows (`MIX`: one-token decode, a 4-draft verify, an 8-node tree verify). A candidate
   whose score, predicted from one chunk of each of its widths, is over `PRUNE` times the
   best prediction is not timed further (a cold plan costs what the close ones cost).
3. **Cached** (`hal.models.plan_cache`) per CPU signature (model name, SIMD flags, cores, threads, torch version) and
   weight shapes under ``$HAL_CACHE/plans``, so a second load costs nothing; a cache written
   under another signature is ignored. ``refresh=True`` (``--plan-refresh``) re-measures. One
   process measures a plan at a time (a lock file beside the cache): another loading the same
   model waits, then reads the cache, instead of timing the first one's contention.

Nothing here is tuned for one microarchitecture: each machine measures and finds its own.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from hal.models import int4
from hal.models import plan_cache, plan_check, q4_rows
from hal.models.machine import BF16_FLAGS, cpu_flags, cpu_signature
from hal.errors import HalError
from hal.models.progress import bar as progress_bar
from hal.models.linear_layout import DTYPES, LAYOUTS, NOISE, STORED, STORED_TYPES, Choice, LinearPlan, chunks

CHOICES = ("auto", "stored", *DTYPES)   # what ``--dtype`` may ask for
LM_HEADS = ("auto", "stored", "float")  # what ``--lm-head`` may ask for (`pin_head`)
MIX = {1: 0.5, 5: 0.25, 9: 0.25}       # rows per forward -> weight in the score (decode, verify k=4, tree of 8)
SCORE_ROWS = tuple(MIX)                 # the rows a candidate is timed at
REPORT_ROWS = (1, 5, 9, 16)
PRUNE = 1.5    # a candidate predicted over this times the best prediction is not timed (its score stays predicted)


def candidate_dtypes(dtype: str, flags: list[str]) -> list[torch.dtype]:
    """The float dtypes ``--dtype`` allows here: auto is float32, plus bfloat16 where the CPU
    has a bf16 unit; stored allows none (every candidate runs the int4 weights as stored)."""
    if dtype not in CHOICES:
        raise HalError(f"dtype: expected one of {', '.join(CHOICES)}, got {dtype!r}", arg="dtype")
    if dtype == "stored":
        return []
    if dtype != "auto":
        return [DTYPES[dtype]]
    return [torch.float32] + ([torch.bfloat16] if any(f in flags for f in BF16_FLAGS) else [])


# The rows int4 candidates multiply, on every CPU: bfloat16 first, float32 only where bfloat16 rows
# give no usable group (the kernel's bf16 path is its vectorized one with or without a bf16 unit:
# benchmarks/results/int4-rows-avx2.md). q4q8 quantizes bfloat16 rows.
INT4_ROWS = (torch.bfloat16, torch.float32)
FALLBACK_ONLY = "int4 with bfloat16 rows is usable; float32 rows are the kernel's scalar path, measured 12-20x slower"


def offered_dtypes() -> list[str]:
    """The dtype names ``--dtype auto`` chooses among on this CPU: float32, plus bfloat16 where it has a bf16 unit."""
    return [str(d).removeprefix("torch.") for d in candidate_dtypes("auto", cpu_flags())]


def time_plan(plan: LinearPlan, weights: list[Tensor], rows=REPORT_ROWS, reps: int = 5) -> dict[int, float]:
    """Median ms of all of ``weights``' products (already in the plan's dtype, on their device)
    at each row count."""
    dev = weights[0].device
    xs = {K: torch.randn(max(rows), K, device=dev) for K in {w.shape[1] for w in weights}}
    sync = getattr(getattr(torch, dev.type, None), "synchronize", lambda: None) if dev.type != "cpu" else lambda: None
    out = {}
    for m in rows:
        def once():
            for w in weights:
                plan.linear(xs[w.shape[1]][:m], w)
            sync()
        once()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        out[m] = round(statistics.median(times) * 1e3, 3)
    return out


def single_chunks(plan: LinearPlan, weights: list, reps: int = 3) -> dict[int, float]:
    """ms of one chunk of each of ``plan``'s widths (all of ``weights``' products)."""
    return {n: time_plan(LinearPlan(plan.layout, plan.dtype, (n,), plan.fn, plan.weights), weights, rows=(n,),
                         reps=reps)[n] for n in plan.widths}


def predicted_score(widths: tuple[int, ...], one: dict[int, float]) -> float:
    """The `MIX` score of ``widths`` predicted from one chunk's time per width (`single_chunks`),
    each row count in its cheapest chunks."""
    costs = tuple(one[n] for n in widths)
    return sum(weight * sum(one[n] for n in chunks(widths, m, costs)) for m, weight in MIX.items())


def fastest_subset(plan: LinearPlan, weights: list, reps: int = 3,
                   one: dict[int, float] | None = None) -> LinearPlan:
    """``plan`` with the subset of its widths that scores best (`MIX`), and their costs (one
    chunk's time each), by which rows then go in the cheapest chunks. Widths of one group give
    a row the same bits, so any subset of them is as invariant as the whole; which is fastest
    depends on the kernel (int4pack at 8 rows costs what two chunks of 4 cost). Each width is
    timed once as a single chunk (or ``one`` gives those times); a subset's score is predicted
    from those."""
    one = one or single_chunks(plan, weights, reps)
    if len(plan.widths) == 1:
        return replace(plan, costs=(one[plan.widths[0]],))
    best, best_score = plan.widths, None
    for mask in range((1 << len(plan.widths)) - 1, 0, -1):    # the whole group first: it wins ties
        subset = tuple(n for j, n in enumerate(plan.widths) if mask >> j & 1)
        predicted = predicted_score(subset, one)
        if best_score is None or predicted < best_score * (1 - 1e-9):
            best, best_score = subset, predicted
    return LinearPlan(plan.layout, plan.dtype, best, plan.fn, plan.weights, costs=tuple(one[n] for n in best))


def score(ms: dict[int, float]) -> float:
    return sum(weight * ms[m] for m, weight in MIX.items())


def choose_plan(shapes: list[tuple[int, int]], dtype: str = "auto", *, weights: list[Tensor] | None = None,
                refresh: bool = False, threads: int | None = None, layouts: dict[str, plan_check.Layout] | None = None,
                reps: int = 3, cache: bool = True, device: torch.device | str | None = None,
                progress: bool = False, stored_int4: list[bool] | None = None, q8_head: bool = False,
                form: str | None = None, stored_q8: list[bool] | None = None, stored_q6: list[bool] | None = None,
                q6k_head: bool = False, stored_q4k: list[bool] | None = None) -> Choice:
    """The fastest usable `LinearPlan` for a model whose linear weights have ``shapes`` ([N, K]
    each, in forward order) on this machine; see the module docstring. ``weights``: those
    weights to time with (default: random ones of the shapes, made only when measuring).
    ``layouts``: the candidates (default `LAYOUTS`; tests plant others). ``stored_int4``: which of
    ``shapes`` the file stores as int4 blocks (Q4_0/Q4_1): ``auto`` then also measures them
    run as stored, and ``stored`` measures only that; ``stored_q8``, ``stored_q6``, ``stored_q4k``:
    as Q8_0, Q6_K, or K-quant mixes (Q4_K, Q5_K, Q5_0 beside Q6_K or Q8_0 parts: q4q8 runs them as its Q8, Q6,
    Q4K, Q5K or Q5 tiles; a mix is timed as Q4K tiles, whose bytes and steps are Q5's and Q5K's but
    their fifth bits). `HalError` when no candidate of the requested dtype is usable.
    ``progress``: a bar (tqdm, stderr) while measuring.
    ``q8_head``: the last of ``shapes`` is an lm_head the file stores as Q8_0 blocks; an int4
    plan then also chooses its form (`LinearPlan.head`, `_choose_head`). ``form``: the stored
    weights are already packed in that form (``int4`` or ``q4q8``): only it is measured."""
    layouts = LAYOUTS if layouts is None else layouts
    dev = torch.device(device) if device is not None else torch.device("cpu")
    signature = cpu_signature(threads, dev)
    shapes = [tuple(int(n) for n in s) for s in shapes]
    candidate_dtypes(dtype, [])   # a bad dtype (or form) is refused before anything is read or measured
    if form not in (None, *STORED):
        raise HalError(f"form: expected None or one of {', '.join(STORED)}, got {form!r}", arg="form")
    # only auto and stored run int4 candidates: a float plan's key (and choice) ignores the storage
    tiles = q4_rows.available()
    int4_shapes, q8_shapes, q6_shapes, q4k_shapes = (
        frozenset(s for s, q in zip(shapes, stored or []) if q and int4.fits(*s))
        if dev.type == "cpu" and dtype in ("auto", "stored") else frozenset()
        for stored in (stored_int4, *((stored_q8, stored_q6, stored_q4k) if tiles else (None,) * 3)))
    q8_shapes -= int4_shapes   # one form a shape
    q6_shapes -= int4_shapes | q8_shapes
    q4k_shapes -= int4_shapes | q8_shapes | q6_shapes
    int4_shapes = plan_check.StoredShapes(int4_shapes | q8_shapes | q6_shapes | q4k_shapes, q8_shapes, q6_shapes,
                                          q4k_shapes)
    if dtype == "stored" and not int4_shapes:
        raise HalError(f"dtype: expected a model with weights stored as Q4_0/Q4_1/Q8_0/Q6_K blocks for 'stored' on "
                       f"a CPU, got {'none' if dev.type == 'cpu' else 'device ' + dev.type}", arg="dtype")
    head = ("q8_0" if q8_head else "q6_k" if q6k_head and tiles else None) \
        if int4_shapes and int4.fits(*shapes[-1]) else None
    families = [f"{str(dt).removeprefix('torch.')} {kind}" for dt, kind in _kinds(dtype, _flags(signature, dev),
                                                                                   int4_shapes, form)]
    families += [f"{head} head"] * bool(head) + [f"{t} {n}x{k}" for t, part in (
        ("q8_0", q8_shapes), ("q6_k", q6_shapes), ("q4_k", q4k_shapes)) for n, k in sorted(part)]
    path = plan_cache.path(signature, shapes, dtype, layouts, int4_shapes, families) \
        if cache and layouts is LAYOUTS else None
    cached = None if path is None or refresh else _cached(path, signature, dtype)
    if cached is not None:
        return cached
    with plan_cache.measuring(path):   # one process measures a plan at a time; the others then read its cache
        cached = None if path is None or refresh else _cached(path, signature, dtype)
        return cached or _measure_and_cache(path, shapes, dtype, weights, signature, layouts, reps, dev, progress,
                                            int4_shapes, head, form)


def _cached(path: Path, signature: dict, dtype: str) -> Choice | None:
    """The plan cached at ``path`` for this signature and dtype, or None (absent, damaged, foreign,
    or without its chunks' costs: measured again once)."""
    saved = plan_cache.load(path, signature, dtype)
    if saved is None:
        return None
    try:
        if not LinearPlan.from_json(saved["plan"]).costs:   # cached before plans kept their chunks' costs
            return None
        return Choice(LinearPlan.from_json(saved["plan"]), signature, saved.get("candidates", []),
                      saved.get("rejected", []), from_cache=True, measured=saved.get("measured") or {},
                      heads=saved.get("heads", []))
    except (ValueError, KeyError, TypeError, HalError):
        return None   # a damaged record: measure again


def _measure_and_cache(path, shapes, dtype, weights, signature, layouts, reps, dev, progress, int4_shapes,
                       head=None, form=None) -> Choice:
    """Measure (`_measure`; once more if noisy) and cache at ``path`` unless still noisy."""
    if weights is None:
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    for _ in range(2):   # a noisy measurement is repeated once; still noisy, it is not cached
        choice = _measure(shapes, dtype, weights, signature, layouts, reps, dev, progress, int4_shapes, head, form)
        if not choice.noisy:
            break
    if path is not None and not choice.noisy:
        plan_cache.store(path, {"signature": signature, "dtype": dtype, "plan": choice.plan.to_json(),
                                "candidates": choice.candidates, "rejected": choice.rejected,
                                "measured": choice.measured, "heads": choice.heads})
    return choice


def _flags(signature: dict, dev: torch.device) -> list[str]:
    """The CPU flags that decide the float families (accelerators: measure bf16 too)."""
    return signature["flags"] if dev.type == "cpu" else list(BF16_FLAGS)


def _kinds(dtype: str, flags: list[str], int4_shapes, form: str | None = None) -> list[tuple[torch.dtype, str]]:
    """(row dtype, weights) of every candidate family ``dtype`` allows (stored: ``form``'s only, if given)."""
    kinds = [(dt, "float") for dt in candidate_dtypes(dtype, flags)]
    quantized = int4_shapes and dtype in ("auto", "stored")
    if not quantized:
        return kinds
    int4pack = bool(plan_check.as_stored(int4_shapes).of("int4"))   # Q8_0 only: no int4pack candidates
    return kinds + [(dt, "int4") for dt in INT4_ROWS] * (form in (None, "int4") and int4pack) + \
        [(INT4_ROWS[0], "q4q8")] * (form in (None, "q4q8") and q4_rows.available())


def _timing_weights(weights: list[Tensor], shapes, dt: torch.dtype, kind: str, int4_shapes, dev) -> list:
    """``weights`` in the candidate's form: stored shapes as random stored weights (timing only)."""
    g = torch.Generator().manual_seed(0)
    stored = plan_check.as_stored(int4_shapes)
    return [stored.stored(kind)(*s, g, dt) if s in stored.of(kind) else
            w if isinstance(w, STORED_TYPES) else w.to(dev, dt)
            for w, s in zip(weights, shapes)]


def _measure(shapes, dtype: str, weights: list[Tensor], signature: dict, layouts, reps: int, dev,
             progress: bool, int4_shapes=frozenset(), head: str | None = None, form: str | None = None) -> Choice:
    """Every usable candidate (`_candidates`), its score predicted from single chunks; those
    within `PRUNE` of the best prediction timed at the `MIX` rows, then the winner once more:
    the spread of its two scores (relative to the lower) says whether the machine was quiet
    enough to trust the choice. A stored winner with a stored ``head`` (its form: q8_0, or q6_k
    for q4q8) then chooses its head's form."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    found, rejected, casts = _candidates(shapes, dtype, weights, signature, layouts, reps, dev, progress,
                                         int4_shapes, form)
    if not found:
        raise HalError(f"dtype {dtype}: expected a batch-invariant linear layout on this CPU, got none usable "
                       f"({'; '.join(rejected[:4])})", arg="dtype")
    floor = min(predicted for _, predicted in found)
    candidates = []
    for plan, predicted in found:
        if predicted > PRUNE * floor:   # far slower by its own chunks: not worth timing
            candidates.append({"plan": plan, "ms": {}, "score": round(predicted, 3), "predicted": True})
            continue
        ms = time_plan(plan, casts[plan.dtype, plan.weights], rows=SCORE_ROWS, reps=reps)
        candidates.append({"plan": plan, "ms": ms, "score": round(score(ms), 3)})
    best = min((c for c in candidates if c["ms"]), key=lambda c: c["score"])
    again = score(time_plan(best["plan"], casts[best["plan"].dtype, best["plan"].weights], rows=SCORE_ROWS,
                            reps=reps))
    spread = abs(again - best["score"]) / max(min(again, best["score"]), 1e-9)
    measured = {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": round(load, 2),
                "spread": round(spread, 3)}
    table = [{**c, "plan": c["plan"].to_json()} for c in candidates]
    plan, heads = best["plan"], []
    if head and plan.weights in STORED and (head == "q8_0" or plan.weights == "q4q8"):
        plan, heads = _choose_head(plan, casts[plan.dtype, plan.weights][-1], shapes[-1], reps, dev, rejected, head)
    return Choice(plan, signature, table, rejected, measured=measured, heads=heads)


def best_of(choice: Choice, weights: str) -> LinearPlan | None:
    """``choice``'s best ``weights``-family candidate by score, its head float (None: none measured)."""
    family = [c for c in choice.candidates if c["plan"]["weights"] == weights]
    return LinearPlan.from_json(min(family, key=lambda c: c["score"])["plan"]) if family else None


def pin_head(choice: Choice, lm_head: str = "auto") -> LinearPlan:
    """``choice``'s plan with the lm_head form a user pinned (``--lm-head``): ``auto`` keeps the
    measured choice, ``float`` the float head in the plan's dtype (always possible), ``stored``
    the Q8_0 (or, on q4q8, Q6_K) codes as stored. ``stored`` needs an int4 plan and an lm_head
    the file stores so that passed the self-check at the plan's widths on this machine (`_choose_head` then
    timed it); otherwise `HalError` naming ``--lm-head`` says which of these is missing. A pin
    skips only the timing, never the self-check."""
    if lm_head not in LM_HEADS:
        raise HalError(f"--lm-head: expected one of {', '.join(LM_HEADS)}, got {lm_head!r}", arg="--lm-head")
    plan = choice.plan
    if lm_head == "auto":
        return plan
    if lm_head == "float":
        return replace(plan, head="float")
    if plan.weights not in STORED:
        raise HalError(f"--lm-head: expected an int4 plan for stored (the Q8_0 head runs on the int4 kernel; "
                       f"try --dtype stored), got {plan.describe()}", arg="--lm-head")
    stored = [h["head"] for h in choice.heads if h["head"] != "float"]
    if not stored:
        why = next((r for r in choice.rejected if " head: " in r), "no stored head in this plan (the file's "
                   "lm_head is not stored as Q8_0 or Q6_K, or its shape does not fit the kernel)")
        raise HalError(f"--lm-head: expected an lm_head stored as Q8_0 or Q6_K that is batch-invariant here for "
                       f"stored, got {why}", arg="--lm-head")
    return replace(plan, head=stored[0])


def _choose_head(plan: LinearPlan, head: Tensor, shape: tuple[int, int], reps: int, dev,
                 rejected: list[str], stored_form: str = "q8_0") -> tuple[LinearPlan, list[dict]]:
    """``plan`` with its lm_head's form: the codes as stored (``stored_form`` q8_0: int4 plan, two
    int4 halves, on the halves' shape ``[N, 2K]``, q4q8 plan, Q8 tiles; q6_k: q4q8's Q6 tiles) where the kernel gives their rows
    the same bits at every one of the plan's widths and they score lower at the `MIX` rows
    than ``head``, the float head in the plan's dtype; else the float head. The two are timed
    interleaved, the lower of two runs each; the table of both is returned."""
    N, K = shape
    q4q8 = plan.weights == "q4q8"
    tiles = plan_check.q6_tiles if stored_form == "q6_k" else plan_check.q8_tiles
    checked, stored = ((N, K), tiles) if q4q8 else ((N, 2 * K), plan_check.int4pack)
    groups, why = plan_check.usable_groups(plan_check.int4_mm, plan.dtype, [checked], widths=plan.widths,
                                           device=dev, int4_shapes=frozenset({checked}), stored=stored)
    if not any(set(plan.widths) <= set(g) for g in groups):
        dt = str(plan.dtype).removeprefix("torch.")
        rejected.append(f"{dt} {stored_form} head: not invariant across widths {'/'.join(map(str, plan.widths))} "
                        f"({'; '.join(why) or 'the widths give a row different bits'})")
        return plan, []
    g = torch.Generator().manual_seed(0)
    forms = {"float": head, stored_form: tiles(N, K, g, plan.dtype) if q4q8 else int4.random_q8(N, K, g).pack(
        plan.dtype, 2)}
    ms: dict[str, dict[int, float]] = {}
    for _ in range(2):
        for form, w in forms.items():
            got = time_plan(plan, [w], rows=SCORE_ROWS, reps=reps)
            ms[form] = {m: min(t, ms.get(form, got)[m]) for m, t in got.items()}
    heads = [{"head": form, "ms": t, "score": round(score(t), 3)} for form, t in ms.items()]
    return replace(plan, head=min(heads, key=lambda h: h["score"])["head"]), heads


def _candidates(shapes, dtype: str, weights: list[Tensor], signature: dict, layouts, reps: int, dev,
                progress: bool, int4_shapes, form: str | None = None
                ) -> tuple[list[tuple[LinearPlan, float]], list[str], dict]:
    """(plan, predicted score) per usable width group of every layout and dtype family, with
    its fastest subset; why other widths were dropped; the weights cast per family."""
    found, rejected, casts = [], [], {}
    kinds = _kinds(dtype, _flags(signature, dev), int4_shapes, form)
    bar = progress_bar(progress, len(kinds) * len(layouts), "linear plan", "layout")
    for dt, kind in kinds:
        if kind == "int4" and dt != INT4_ROWS[0] and any(p.weights == "int4" for p, _ in found):
            rejected.append(f"{str(dt).removeprefix('torch.')} int4: not measured ({FALLBACK_ONLY})")
            bar.update(len(layouts))
            continue
        casts[dt, kind] = cast = _timing_weights(weights, shapes, dt, kind, int4_shapes, dev)
        stored = plan_check.as_stored(int4_shapes)
        for name, fn in layouts.items():
            groups, why = plan_check.usable_groups(fn, dt, sorted(set(shapes)), device=dev,
                                                   int4_shapes=stored.of(kind), stored=stored.stored(kind))
            label = f"{str(dt).removeprefix('torch.')}{f' {kind}' * (kind in STORED)} {name}"
            rejected += [f"{label}: {w}" for w in why]
            for group in groups:
                plan = LinearPlan(name, dt, group, None if LAYOUTS.get(name) is fn else fn, weights=kind)
                one = single_chunks(plan, cast, reps)
                plan = fastest_subset(plan, cast, reps, one)
                found.append((plan, predicted_score(plan.widths, one)))
            bar.update()
    bar.close()
    return found, rejected, casts
