"""Where a forward's time goes (SmolLM2-135M, GGUF Q4_1, 200 cached tokens, the auto plan):
linears, attention, norms and RoPE, KV writes, everything else the forward runs, and the
host time between ops, for a one-token decode and a 5-token verify; one engine step (decode
of one request) against its forward alone; and the KV writes as one native call per layer
against the backend op per layer, side by side. Writes benchmarks/results/breakdown.md.

Every op the profiler records (torch.profiler, CPU) is charged to the innermost function of
the runner it was called from (the profiler's Python-function events above it): `LinearPlan.linear` -> linears,
`invariant.attention` / `Plan` -> attention, `_rms_norm` and `Rope` -> norms and RoPE,
`write_kv` -> KV writes. "host" is the wall time no op covers (Python, dispatch).

    python benchmarks/breakdown.py [--reps 20] [--threads 2] [--dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hal
from forward import CTX, batch_decode, ours as decode_fn   # M fed tokens after CTX cached ones
from report import publish
from hal.engine import Request, SpeculativeDecoder
from hal.models import invariant
from hal.models.fetch import fetch
from hal.models.loaders import load_gguf
from hal.models.machine import machine_line

PARTS = [("linears", ("linear_plan.py(", "plan_check.py(")), ("attention", ("invariant.py(",)),
         ("KV writes", ("write_kv",)), ("norms and RoPE", ("_rms_norm", "Rope", "apply")),
         ("embed, head rows, residuals", ("llama.py(",))]


def part_of(evt) -> str:
    """The part an op is charged to: the innermost runner function among its callers (the
    profiler's Python-function events above it)."""
    parent = evt.cpu_parent
    while parent is not None:
        for name, marks in PARTS:
            if _is_python(parent) and any(mark in parent.name for mark in marks):
                return name
        parent = parent.cpu_parent
    return "batch metadata (hal.engine.forward)"


def _is_python(evt) -> bool:
    return "): " in evt.name or evt.name.startswith("<built-in")


def breakdown(fn, reps: int) -> tuple[float, dict[str, float]]:
    """Median wall ms of ``fn``, and ms per call of each part (ops' self time, by caller)."""
    for _ in range(3):
        fn()
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(reps):
            fn()
    parts: dict[str, float] = {}
    for evt in prof.events():
        if _is_python(evt):
            continue
        name = part_of(evt)
        parts[name] = parts.get(name, 0.0) + evt.self_cpu_time_total / 1e3 / reps
    return statistics.median(walls) * 1e3, parts


def engine_step(model, tok, reps: int) -> tuple[float, float]:
    """Mean ms of one decode step of one request (schedule, forward, sample, commit), and the
    part of it spent outside the model's forward (the same steps, timed around the forward)."""
    dec = SpeculativeDecoder(model, None, num_blocks=64)
    ids = tok.encode("Write a short story about a lighthouse keeper.").ids
    dec.add(Request(ids, max_new_tokens=reps + 8, k=0))   # no stop ids: it runs to max_new_tokens
    for _ in range(4):   # prefill, then warm decode steps
        dec.step()
    inner, real = [0.0], model.forward

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            inner[0] += time.perf_counter() - t
    model.forward = timed
    try:
        t = time.perf_counter()
        for _ in range(reps):
            dec.step()
        total = time.perf_counter() - t
    finally:
        del model.forward
    return total / reps * 1e3, (total - inner[0]) / reps * 1e3


def kv_writes_side_by_side(model, reps: int) -> dict[tuple[int, str], float]:
    """Median forward ms at M = 1 and 5, interleaved: layers after the first writing their KV
    in one native call each (`invariant.write_kv`, the default) against the backend's
    ``write_kv`` op per layer (what every layer did before)."""
    fused = invariant.write_kv
    fns = {m: decode_fn(model, m) for m in (1, 5)}
    times = {(m, mode): [] for m in fns for mode in ("backend op per layer", "one native call")}
    try:
        for _ in range(reps):
            for m, mode in times:
                invariant.write_kv = fused if mode == "one native call" else (lambda *a: False)
                t = time.perf_counter()
                fns[m]()
                times[m, mode].append(time.perf_counter() - t)
    finally:
        invariant.write_kv = fused
    return {key: statistics.median(v) * 1e3 for key, v in times.items()}


class _GeneralPlan(invariant.Plan):
    """The attention metadata with the decode-only path off: every forward takes the general one."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.decode_only = False


class _MaskedPlan(invariant.Plan):
    """The attention metadata without the host lengths: values past each end zeroed by the
    broadcast mask (what every forward did before)."""

    def __init__(self, block_tables, seq_lens, *a, **kw):
        super().__init__(block_tables, seq_lens, *a, **kw)
        self.ends = None   # the plan's own mask, which it builds only without host lengths
        self.dead = invariant.dead_mask(self.Lp, seq_lens)


def plans_side_by_side(fns: dict, plans: dict[str, type], reps: int) -> dict[tuple[int, str], float]:
    """Median forward ms of each of ``fns`` under each attention ``plans`` class, interleaved;
    their logits must be bit-identical."""
    real = invariant.Plan
    times = {(r, mode): [] for r in fns for mode in plans}
    try:
        for rep in range(reps + 1):
            want = {}
            for r, mode in times:
                invariant.Plan = plans[mode]
                t = time.perf_counter()
                logits = fns[r]()[0]
                if rep:
                    times[r, mode].append(time.perf_counter() - t)
                elif not torch.equal(logits, want.setdefault(r, logits)):
                    raise SystemExit(f"the logits under {mode} differ from those under {next(iter(plans))} ({r})")
    finally:
        invariant.Plan = real
    return {key: statistics.median(v) * 1e3 for key, v in times.items()}


def decode_path_side_by_side(model, reps: int) -> dict[tuple[int, str], float]:
    """One-token decodes (1 and 4 requests): the attention's decode-only path (the default)
    against the general path it replaces."""
    return plans_side_by_side({1: decode_fn(model, 1), 4: batch_decode(model, 4)},
                              {"general": _GeneralPlan, "decode-only": invariant.Plan}, reps)


def value_fill_side_by_side(model, reps: int) -> dict[tuple[str, str], float]:
    """Decodes of 1 and 4 requests and a 5-row verify: the values past each end zeroed by one
    fill per request from the host lengths (the default) against the broadcast mask."""
    fns = {"decode, 1 request": decode_fn(model, 1), "decode, 4 requests": batch_decode(model, 4),
           "verify, M=5": decode_fn(model, 5)}
    return plans_side_by_side(fns, {"mask": _MaskedPlan, "fill": invariant.Plan}, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/breakdown.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_gguf(fetch("smollm2-135m"), hal.get_backend("cpu"), args.dtype)
    rows = {}
    with torch.inference_mode():
        step = engine_step(model, tok, args.reps)   # before the profiler has run in this process
        ab = kv_writes_side_by_side(model, 2 * args.reps)
        paths = decode_path_side_by_side(model, 2 * args.reps)
        fills = value_fill_side_by_side(model, 2 * args.reps)
        for m in (1, 5):
            rows[m] = breakdown(decode_fn(model, m), args.reps)
    names = [n for n, _ in PARTS] + ["batch metadata (hal.engine.forward)"]
    lines = [f"# Where a forward's time goes (SmolLM2-135M, {CTX} cached tokens, --dtype {args.dtype})", "",
             f"Command: `python benchmarks/breakdown.py --reps {args.reps} --threads {args.threads} --dtype "
             f"{args.dtype}`; {time.strftime('%Y-%m-%d')}.", "", machine_line(model.plan, args.threads) + ".", "",
             "Op self time per forward (torch.profiler, charged by caller); host = median wall time "
             "(unprofiled) less the ops' sum.", "",
             "| part | decode M=1 ms | share | verify M=5 ms | share |", "|---|---:|---:|---:|---:|"]
    for n in names + ["host (Python, dispatch)"]:
        cells = []
        for m in (1, 5):
            wall, parts = rows[m]
            v = wall - sum(parts.values()) if n.startswith("host") else parts.get(n, 0.0)
            cells += [f"{v:.2f}", f"{v / wall:.0%}"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append(f"| **forward (wall)** | **{rows[1][0]:.2f}** | | **{rows[5][0]:.2f}** | |")
    lines += ["", f"One engine decode step (one request, k=0: schedule, forward, sample, commit): {step[0]:.2f} ms, "
              f"of which {step[1]:.2f} ms outside the model's forward (the same {args.reps} steps)."]
    lines += ["", "KV writes side by side (interleaved, medians of {} forwards each):".format(2 * args.reps), "",
              "| M | backend op per layer ms | one native call per layer ms | ratio |", "|---:|---:|---:|---:|"]
    lines += [f"| {m} | {ab[m, 'backend op per layer']:.2f} | {ab[m, 'one native call']:.2f} | "
              f"{ab[m, 'one native call'] / ab[m, 'backend op per layer']:.3f} |" for m in (1, 5)]
    lines += ["", "Attention of one-token decodes side by side (interleaved, medians of {} forwards each; the "
              "logits bit-identical):".format(2 * args.reps), "",
              "| requests | general path ms | decode-only path ms | ratio |", "|---:|---:|---:|---:|"]
    lines += [f"| {r} | {paths[r, 'general']:.2f} | {paths[r, 'decode-only']:.2f} | "
              f"{paths[r, 'decode-only'] / paths[r, 'general']:.3f} |" for r in (1, 4)]
    lines += ["", "Values past each sequence's end zeroed side by side (interleaved, medians of {} forwards each; "
              "the logits bit-identical): the broadcast mask against one fill per request from the host "
              "lengths:".format(2 * args.reps), "",
              "| forward | mask ms | fill ms | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {f} | {fills[f, 'mask']:.2f} | {fills[f, 'fill']:.2f} | {fills[f, 'fill'] / fills[f, 'mask']:.3f} |"
              for f in dict.fromkeys(f for f, _ in fills)]
    publish(lines, args.out)


if __name__ == "__main__":
    with torch.inference_mode():   # as the engine's steps run (`SpeculativeDecoder.step`)
        main()
