"""Which rows the int4 weights as stored should multiply on this CPU: all of SmolLM2-135M's
linears (30 layers' fused qkv, o, gate-up and down, plus the lm_head) at M rows, as int4
(group 32, `hal.models.int4`, the kernel the plan runs) with bfloat16 rows and with float32
rows, beside float32 and bfloat16 ``F.linear`` of float weights; interleaved, medians. The
linear plan (`hal.models.linear_plan`) measures bfloat16 rows on every CPU and float32 rows
only where bfloat16 rows give no usable group; this is the evidence for that rule, per CPU.

A second table times the lm_head alone (SmolLM2's head is the Q8_0 embedding) as the plan runs
it now (bfloat16 ``mm``) against the Q8_0 codes run exactly as int4pack: ``q = 16·hi + lo``
(``hi`` in -8..7, ``lo`` in 0..15) makes two int4 halves, stacked along K into one kernel
call on ``[x, x]`` (scale 16d / zero 0, then scale d / zero 8d), with each one's largest
|error| against the float64 product. Not a plan candidate yet: the evidence for making it one.

    python benchmarks/int4_rows.py [--reps 5] [--threads 2] [--out benchmarks/results/int4-rows.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import publish  # noqa: E402
from hal.models import int4  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402

H, FFN, V, LAYERS, HEADS, KV, D = 576, 1536, 49152, 30, 9, 3, 64
SHAPES = [((HEADS + 2 * KV) * D, H), (H, HEADS * D), (2 * FFN, H), (H, FFN)] * LAYERS + [(V, H)]
MS = (1, 2, 4, 8, 16)
KINDS = {   # name -> (weights: float or int4, row dtype)
    "float32 F.linear": ("float", torch.float32),
    "bfloat16 F.linear": ("float", torch.bfloat16),
    "int4, bfloat16 rows": ("int4", torch.bfloat16),
    "int4, float32 rows": ("int4", torch.float32),
}


def weights(kind: str, dtype: torch.dtype) -> list:
    g = torch.Generator().manual_seed(0)
    if kind == "int4":
        return [int4.random(n, k, g).pack(dtype) for n, k in SHAPES]
    return [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in SHAPES]


def forward(ws: list, xs: dict[int, torch.Tensor]) -> None:
    for w in ws:
        x = xs[w.shape[1]]
        w.mm(x) if isinstance(w, int4.Int4Weight) else F.linear(x, w)


def q8_head_as_int4(V: int, K: int, g: torch.Generator):
    """Random Q8_0 codes and block scales for a [V, K] head: (float weights, one int4pack weight
    of [V, 2K] whose product with ``[x, x]`` is exactly ``x @ (d·q).T`` before the rows' rounding)."""
    q = torch.randint(-127, 128, (V, K), generator=g)
    d = torch.rand(V, K // int4.GROUP, generator=g) * 0.01 + 1e-3
    w = (q.view(V, K // int4.GROUP, int4.GROUP).float() * d[..., None]).view(V, K)
    lo = q & 15
    hi = (q - lo) // 16
    blocks = int4.Int4Blocks(torch.cat([hi + 8, lo], 1).to(torch.uint8), torch.cat([16 * d, d], 1),
                             torch.cat([torch.zeros_like(d), 8 * d], 1))
    return w, blocks.pack(torch.bfloat16)


def head_table(reps: int) -> list[str]:
    g = torch.Generator().manual_seed(2)
    w, halves = q8_head_as_int4(V, H, g)
    wb = w.to(torch.bfloat16)
    x = torch.randn(max(MS), H, generator=g)
    ref = x.double() @ w.double().T
    fns = {"bfloat16 mm (the plan's head now)": lambda r: torch.mm(wb, r.T).T,
           "Q8_0 as int4pack halves, one call": lambda r: halves.mm(torch.cat([r, r], 1))}
    ms, err = {}, {}
    with torch.inference_mode():
        for m in MS:
            r = x[:m].to(torch.bfloat16)
            for name, fn in fns.items():
                err[name] = max(err.get(name, 0.0), float((fn(r).double() - ref[:m]).abs().max()))
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    fn(r)
                    times.append(time.perf_counter() - t)
                ms[name, m] = statistics.median(times) * 1e3
    return ["", f"The lm_head alone ([{V}, {H}], Q8_0 codes and block scales, bfloat16 rows), ms; max |error| "
                "against the float64 product over every M:", "",
            "| head | " + " | ".join(f"M={m}" for m in MS) + " | max abs error |", "|---|" + "---:|" * (len(MS) + 1)] + \
        [f"| {name} | " + " | ".join(f"{ms[name, m]:.2f}" for m in MS) + f" | {err[name]:.3f} |" for name in fns]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/int4-rows.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ws = {name: weights(kind, dt) for name, (kind, dt) in KINDS.items()}
    g = torch.Generator().manual_seed(1)
    rows = {m: {k: torch.randn(m, k, generator=g) for k in (H, FFN)} for m in MS}
    xs = {(name, m): {k: x.to(dt) for k, x in rows[m].items()} for name, (_, dt) in KINDS.items() for m in MS}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in xs}
    with torch.inference_mode():
        for key in xs:                  # warm-up
            forward(ws[key[0]], xs[key])
        for _ in range(args.reps):      # interleaved: every kind and M once per round
            for key in xs:
                t = time.perf_counter()
                forward(ws[key[0]], xs[key])
                times[key].append(time.perf_counter() - t)
    ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    lines = ["# int4 weights with bfloat16 or float32 rows, beside float linears (SmolLM2-135M's linears)", "",
             f"Command: `python benchmarks/int4_rows.py --reps {args.reps} --threads {args.threads}`; "
             f"{time.strftime('%Y-%m-%d')}; {machine_line(threads=args.threads)}. ms per forward (all 30 layers' "
             f"linears and the lm_head), medians of {args.reps} interleaved rounds.", "",
             "| weights / rows | " + " | ".join(f"M={m}" for m in MS) + " |", "|---|" + "---:|" * len(MS)]
    lines += [f"| {name} | " + " | ".join(f"{ms[name, m]:.1f}" for m in MS) + " |" for name in KINDS]
    best = min(KINDS, key=lambda name: ms[name, 1])
    lines += ["", f"Fastest at M=1: {best}; int4 float32 rows / bfloat16 rows at M=1: "
                  f"{ms['int4, float32 rows', 1] / ms['int4, bfloat16 rows', 1]:.1f}x."]
    publish(lines + head_table(args.reps), args.out)


if __name__ == "__main__":
    main()
