"""Does the default cost anything at a batch of requests where nothing pays? The routed default
(``--draft`` ``--mode``, k <= 6, the router's defaults: what ``spec-hal serve`` runs) against
plain decoding, on sampled open-ended chat (temperature 0.7, a seed per request, ``--tokens``
each), at each of ``--batches`` requests at a time: each engine is refilled to the batch size as
requests finish, from its own copy of one request list (the same prompts and seeds). Three engines
step in turn, the order rotated step by step, so a busy spell of a shared machine lands on all:
plain, routed, and a second plain engine (the noise floor: two identical engines differ this much).

Reported per batch size: each engine's total step time over plain's (every step: prefills, refills
and partial batches too), the routed engine's steps that drafted anything, and the host's time
outside the forward (`routing.ForwardTimer`) per step at the full batch, routed and plain (medians):
what routing adds on the host, free of the forward's noise.

    python benchmarks/batch_sizes.py [--batches 1,4,8,16] [--requests 32] [--tokens 64] [--rounds 2]
        [--mode ngram] [--out benchmarks/results/batch-sizes.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from defaults import OPEN as TUNED  # noqa: E402
from routing import OPEN, ForwardTimer, bundled, publish  # noqa: E402

NAMES = ("plain", "routed", "plain2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per batch size and round")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mode", default="ngram")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be, model, tok, template = bundled(tempfile.mkdtemp(prefix="hal-route-memory-"))
    from hal.cli import measured_costs
    from hal.launch.build import cli_drafter
    from hal.models.machine import machine_line
    from hal.models.tokenizer import prompt_ids
    costs = measured_costs(model, cli_drafter(args.mode, model, be), max_tokens=7)
    prompts = [prompt_ids(tok, template, p) for p in OPEN + TUNED]
    rows = {b: run(model, be, args, costs, prompts, b) for b in map(int, args.batches.split(","))}
    write(args, rows, machine_line(model.plan))


def run(model, be, args, costs, prompts, batch: int) -> dict:
    from hal.engine import Request
    from hal.launch.build import build_engine, cli_drafter, local_pool
    total, host, plain_steps, drafted, full = defaultdict(float), defaultdict(list), [], 0, 0
    for rnd in range(args.rounds):
        es = {}
        for name in NAMES:
            drafter = cli_drafter(args.mode, model, be) if name == "routed" else None
            es[name] = build_engine(model, drafter, k=6, route=drafter is not None, costs=costs,
                                    pool=local_pool(model, batch, 1024 + args.tokens, 6))
        pending = {name: [Request(prompts[i % len(prompts)], max_new_tokens=args.tokens, temperature=0.7,
                                  seed=1000 * rnd + i, k=0 if name.startswith("plain") else 6)
                          for i in range(args.requests)] for name in NAMES}
        i = 0
        with ForwardTimer() as forward:
            while any(pending[n] or es[n].has_unfinished() for n in NAMES):
                for name in NAMES[i % 3:] + NAMES[:i % 3]:   # the order rotated step by step
                    e, s = es[name], es[name].scheduler
                    while pending[name] and len(s.running) + len(s.prefilling) + len(s.waiting) < batch:
                        e.add(pending[name].pop(0))
                    if not e.has_unfinished():
                        continue
                    forward.seconds, t0 = 0.0, time.perf_counter()
                    out = e.step()
                    dt = time.perf_counter() - t0
                    total[name] += dt
                    if name == "routed":
                        drafted += bool(sum(out.k.values()))
                        full += len(out.k) == batch
                    if len(out.k) == batch and not sum(out.k.values()) and name != "plain2":
                        host[name].append(dt - forward.seconds)
                        if name == "plain":
                            plain_steps.append(dt)
                i += 1
    return {"total": {n: total[n] / total["plain"] for n in NAMES}, "drafted": drafted, "full": full,
            "host": {n: statistics.median(host[n]) for n in ("routed", "plain")},
            "plain_step": statistics.median(plain_steps)}


def write(args, rows: dict, machine: str) -> None:
    cmd = "python benchmarks/batch_sizes.py " + " ".join(sys.argv[1:])
    lines = [f"# The routed default against plain decoding at each batch size, {time.strftime('%Y-%m-%d')}", "",
             f"Command: `{cmd}`. {machine}. Bundled SmolLM2-135M (GGUF Q4_1), `{args.mode}` routed (k <= 6); "
             f"{args.requests} sampled open-ended requests (T=0.7, {args.tokens} tokens each) per batch size and "
             f"round, {args.rounds} rounds; plain, routed and a second plain engine stepped in turn.", "",
             "| batch | routed total / plain | second plain / plain | routed steps that drafted (of those at the "
             "full batch) | host outside the forward, routed / plain (µs a step) | the difference / plain step |",
             "|---|---|---|---|---|---|"]
    for b, r in rows.items():
        t, h = r["total"], r["host"]
        lines.append(f"| {b} | {t['routed']:.3f} | {t['plain2']:.3f} | {r['drafted']} ({r['full']}) | "
                     f"{h['routed'] * 1e6:.0f} / {h['plain'] * 1e6:.0f} | "
                     f"{(h['routed'] - h['plain']) / r['plain_step'] * 100:+.2f}% ({r['plain_step'] * 1e3:.1f}) |")
    lines += ["", "Total: every step of the engine, prefills and partial batches too. Host outside the forward: a "
              "step's time less `hal.engine.execution.execute`'s but for its lookahead drafting "
              "(`benchmarks/routing.py`'s `ForwardTimer`), medians over the steps at the full batch that drafted "
              "nothing; the difference is over plain's median step at the full batch (its ms in brackets)."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
