"""Rows in the cheapest chunks against the narrowest chunk that holds them, side by side in one
run: the same plan (layout, dtype, widths) with and without its measured costs per width
(`hal.models.linear_layout.chunks`), forwards of M fed rows after 200 cached tokens,
alternating; the logits must be bit-identical (the benchmark stops otherwise).

    python benchmarks/chunk_costs.py [--reps 25] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

import hal
from forward import CTX, ours   # M fed tokens after CTX cached ones
from report import publish
from hal.models.fetch import fetch
from hal.models.linear_layout import chunks
from hal.models.linear_plan import single_chunks
from hal.models.llama import linear_weights
from hal.models.loaders import load_gguf
from hal.models.machine import machine_line

ROWS = (1, 3, 5, 6, 9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/chunk-costs.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_gguf(fetch("smollm2-135m"), hal.get_backend("cpu"), "auto")
    weights = linear_weights(model.w, model.cfg.layers, model.head_lin)[:-1]   # the layers' linears
    one = single_chunks(replace(model.plan, costs=()), weights)
    costed = replace(model.plan, costs=tuple(one[n] for n in model.plan.widths))
    plain = replace(model.plan, costs=())
    lines = ["# Rows in the cheapest chunks against the narrowest chunk that holds them", "",
             f"Command: `python benchmarks/chunk_costs.py --reps {args.reps} --threads {args.threads}`; "
             f"{time.strftime('%Y-%m-%d')}; {machine_line(model.plan, args.threads)}. One chunk of each width "
             f"(all layers' linears): " + ", ".join(f"{n}: {one[n]:.2f} ms" for n in model.plan.widths) +
             f". Forwards of M rows after {CTX} cached tokens, medians of {args.reps}, alternating; logits "
             "bit-identical.", "",
             "| M | chunks (narrowest) | chunks (cheapest) | narrowest ms | cheapest ms | ratio |",
             "|---:|---|---|---:|---:|---:|"]
    for m in ROWS:
        f = ours(model, m)
        times, logits = {}, {}
        for plan in (plain, costed, plain, costed):   # warm both
            model.plan = plan
            logits[plan.costs] = f()[0]
        if not torch.equal(logits[plain.costs], logits[costed.costs]):
            raise SystemExit(f"M={m}: the logits differ between the two chunkings")
        for _ in range(args.reps):
            for plan in (plain, costed):
                model.plan = plan
                t0 = time.perf_counter()
                f()
                times.setdefault(plan.costs, []).append(time.perf_counter() - t0)
        a, b = (statistics.median(times[p.costs]) * 1e3 for p in (plain, costed))
        lines.append(f"| {m} | {'+'.join(map(str, chunks(plain.widths, m)))} | {'+'.join(map(str, chunks(costed.widths, m, costed.costs)))} "
                     f"| {a:.2f} | {b:.2f} | {b / a:.3f} |")
        print(lines[-1], flush=True)
    publish(lines, args.out)


if __name__ == "__main__":
    with torch.inference_mode():   # as the engine's steps run
        main()
