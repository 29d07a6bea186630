"""What speculation can buy on this CPU at best: the measured cost table and acceptance curves
put into Leviathan et al.'s expectation, for issue 35's open-ended bars (>= 1.8x plain decoding).

Measured here, in one run: the router's cost table (`SpeculativeDecoder.profile_costs`: a
target forward over T fed tokens after ``--context`` cached ones, and each drafter's chain of k),
and each drafter's acceptance by position on the held-out-topic prompts (greedy, every proposal
verified at a fixed k: the engine's `acceptance_by_position`, P_j = P(draft j is reached and
accepted)). Then, per drafter and k, with c(T) the cost of a forward over T tokens and d(k) the
draft chain's:

    predicted speedup S(k) = (1 + P_1 + ... + P_k) / ((c(k + 1) + d(k)) / c(1))

the best fixed k; an oracle that drafts exactly the number a step will accept (A, drawn from the
same curve: P(A = j) = P_j - P_(j+1)), E[A + 1] / E[(c(A + 1) + d(A)) / c(1)]; the same curve
scaled to issue 35's held-out tau of 2.45; a perfect drafter (every draft accepted); and the
per-position acceptance a (a geometric curve, P_j = a^j) that the best k needs for 1.8x. These
are ceilings: no host time, no routing error, no probes. The engine's measured speed is below.

    python benchmarks/spec_ceiling.py [--prompts 12] [--max-new-tokens 48] [--k 7] [--context 200] [--threads 2]
                                      [--reps 9]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hal
from hal.drafters.kinds import make_drafter, parse_draft
from hal.engine import SpeculativeDecoder
from hal.engine.requests import Request
from hal.launch.build import build_engine
from hal.models.fetch import load_model
from hal.models.machine import machine_line
from hal.models.tokenizer import chatml
from hal.training import data

TARGET_TAU, TARGET_SPEEDUP = 2.45, 1.8


def curve(target, drafter, ids: list[list[int]], k: int, max_new_tokens: int) -> list[float]:
    """P_1..P_k: the share of verify steps whose draft j was reached and accepted."""
    dec = build_engine(target, drafter, k=k)
    dec.generate([Request(p, max_new_tokens=max_new_tokens, k=k, stop_ids=target.cfg.stop_ids) for p in ids])
    return list(dec.metrics.total.acceptance_by_position()[:k])


def step_cost(costs, k: int, ctx: int) -> float:
    """Seconds of a step of one request verifying k drafts (its chain of k drafted first)."""
    return costs.cost(k + 1, (k + 1) * ctx, k)


def speedups(costs, P: list[float], ctx: int) -> list[float]:
    """S(k) for k = 0..len(P) (see the module docstring)."""
    one = step_cost(costs, 0, ctx)
    return [(1 + sum(P[:k])) / (step_cost(costs, k, ctx) / one) for k in range(len(P) + 1)]


def oracle(costs, P: list[float], ctx: int) -> float:
    one, Q = step_cost(costs, 0, ctx), [1.0] + list(P) + [0.0]
    pa = [Q[j] - Q[j + 1] for j in range(len(P) + 1)]   # P(A = j), j = 0..k
    tokens = sum(p * (j + 1) for j, p in enumerate(pa))
    return tokens / sum(p * step_cost(costs, j, ctx) / one for j, p in enumerate(pa))


def needed(costs, k: int, ctx: int) -> float | None:
    """The least per-position acceptance a (P_j = a^j) whose best S(k') reaches TARGET_SPEEDUP."""
    lo, hi = 0.0, 1.0
    if max(speedups(costs, [1.0] * k, ctx)) < TARGET_SPEEDUP:
        return None
    for _ in range(40):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if max(speedups(costs, [a ** j for j in range(1, k + 1)], ctx)) < TARGET_SPEEDUP else (lo, a)
    return hi


def row(name: str, costs, P: list[float], ctx: int, k: int) -> list[str]:
    s = speedups(costs, P, ctx)
    best = max(range(len(s)), key=s.__getitem__)
    scale = (TARGET_TAU - 1) / sum(P) if sum(P) else 0.0
    at_target = [min(1.0, p * scale) for p in P]
    a = needed(costs, k, ctx)
    return [name, f"{1 + sum(P):.2f}", f"{best}", f"{s[best]:.2f}x", f"{oracle(costs, P, ctx):.2f}x",
            f"{max(speedups(costs, at_target, ctx)):.2f}x", f"{max(speedups(costs, [1.0] * k, ctx)):.2f}x",
            "never" if a is None else f"{a:.2f} (tau {1 + sum(a ** j for j in range(1, k + 1)):.2f})"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=7, help="drafts per step while measuring the curves (the block's 7)")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before each costed step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9, help="timings per cost point (the least is kept)")
    ap.add_argument("--out", default="benchmarks/results/spec-ceiling.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    ids = [tok.encode(chatml(p)).ids for p in data.prompts(heldout=True)[:args.prompts]]
    rows = []
    with torch.inference_mode():
        for label, kind in (("EAGLE head, chain", "eagle"), ("DSpark block drafter", "dspark")):
            make = lambda: make_drafter(parse_draft(kind), target.be, target, "smollm2-135m")  # noqa: E731
            costs = SpeculativeDecoder(target, make(), num_blocks=256).profile_costs(
                max_tokens=args.k + 2, context=args.context, reps=args.reps)
            rows.append(row(label, costs, curve(target, make(), ids, args.k, args.max_new_tokens), args.context,
                            args.k))
            one = step_cost(costs, 0, args.context)
            rows[-1].append(", ".join(f"{step_cost(costs, j, args.context) / one:.2f}" for j in range(args.k + 1)))
    lines = ["# What speculation can buy on this CPU at best (issue 35's open-ended bars)", "",
             f"`python benchmarks/spec_ceiling.py --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
             f"--k {args.k} --context {args.context} --threads {args.threads} --reps {args.reps}`; "
             f"{machine_line(target.plan)}; "
             f"{time.strftime('%Y-%m-%d')}; greedy, {len(ids)} held-out-topic prompts, every proposal verified "
             f"at k = {args.k}; costs profiled after {args.context} cached tokens, one request.", "",
             f"| drafter | measured tau (k = {args.k}) | best k | its speedup | oracle k | at tau {TARGET_TAU:.2f} | "
             f"perfect drafter | acceptance per position for {TARGET_SPEEDUP:.1f}x | step cost / decode, k = "
             f"0..{args.k} |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Ceilings, not measurements of the engine: no host time, routing error or probes. \"at tau "
              f"{TARGET_TAU}\": the measured curve scaled to that held-out tau (issue 35's first bar). The step "
              "cost includes the drafter's chain of k."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
