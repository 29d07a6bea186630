"""The q4q8 kernel (`hal.models.q4_rows`: the stored int4 and Q8_0 weights times rows quantized
to int8, integer dot products) against PyTorch's int4pack kernel, side by side: SmolLM2-135M
(GGUF Q4_1, Q8_0 head), 200 cached tokens, the same file loaded under the plan this machine
chose with q4q8 and under the best int4pack plan of the same measurement (its Q8_0 head as
two int4 halves), both with the fused row kernels and the native layer loop, interleaved in
one run (medians). Cases: a one-token decode, verifies of 5 and 9 tokens, batched decodes of 4
and 16 requests. Also each plan's cost of a verify against a decode (what speculation has to
beat), how far the two plans' logits are apart, and whether their greedy tokens agree.
Writes benchmarks/results/q4q8.md.

    python benchmarks/q4q8.py [--reps 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import hal
from forward import CASES, interleaved
from report import publish
from hal.models.fetch import fetch
from hal.models.linear_plan import best_of
from hal.models.loaders import load_gguf
from hal.models.machine import machine_line

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/q4q8.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path, be = fetch("smollm2-135m"), hal.get_backend("cpu")
    q4 = load_gguf(path, be, "auto")[0]
    if q4.plan.weights != "q4q8":
        raise SystemExit(f"this machine's plan is not q4q8 ({q4.plan.describe()}): nothing to compare")
    i4 = load_gguf(path, be, plan=replace(best_of(q4.plan_choice, "int4"), head="q8_0"))[0]   # the same measurement's
    models = {"int4pack": i4, "q4q8": q4}
    fns = {(name, kind): make(model, n) for name, make, n in CASES for kind, model in models.items()}
    outs = {key: fn() for key, fn in fns.items()}   # warm-up, and the logits compared below
    med = interleaved(fns, args.reps)
    lines = ["# The q4q8 kernel against int4pack (SmolLM2-135M, 200 cached tokens)", "",
             f"Command: `python benchmarks/q4q8.py --reps {args.reps} --threads {args.threads}`; medians of "
             f"{args.reps} interleaved runs, {time.strftime('%Y-%m-%d')}.", "",
             f"{machine_line(None, args.threads)}.", "",
             f"- int4pack: {i4.plan.describe()}; native layer loop: {'yes' if i4.loop else 'no'}",
             f"- q4q8: {q4.plan.describe()}; native layer loop: {'yes' if q4.loop else 'no'}", "",
             "| forward | int4pack ms | q4q8 ms | q4q8 / int4pack | int4pack / its decode | q4q8 / its decode | "
             "max abs logit difference | greedy tokens agree |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    one = {kind: med[(CASES[0][0], kind)] for kind in models}
    for name, _, _ in CASES:
        a, b = med[(name, "int4pack")], med[(name, "q4q8")]
        la, lb = outs[(name, "int4pack")][0], outs[(name, "q4q8")][0]
        agree = int((la.argmax(-1) == lb.argmax(-1)).sum())
        lines.append(f"| {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.3f} | {a / one['int4pack']:.2f} | "
                     f"{b / one['q4q8']:.2f} | {float((la - lb).abs().max()):.4f} | {agree}/{la.shape[0]} |")
    lines += ["", "Each forward feeds its tokens after 200 cached ones (`benchmarks/forward.py`'s cases); the logits "
              "compared are each plan's first forward of the case. \"/ its decode\" is the forward's time over the "
              "same plan's one-token decode."]
    publish(lines, args.out)


if __name__ == "__main__":
    with torch.inference_mode():   # as the engine's steps run (`SpeculativeDecoder.step`)
        main()
