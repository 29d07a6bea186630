"""The fused row kernels against eager ATen ops, side by side (SmolLM2-135M, GGUF Q4_1, 200
cached tokens, the plan this machine chose): the same model and weights with
``fused_rows=True`` (norms, SwiGLU, RoPE and the batch-invariant attention as
`hal.models.row_kernels`) and ``False`` (`hal.models.invariant`'s ATen attention and the
eager steps), interleaved in one run (medians), for a one-token decode, verifies of 5 and 9
tokens, and batched decodes of 4 and 16 requests. Also how far the two paths' logits are
apart (they sum in different orders) and whether their greedy tokens agree. Writes
benchmarks/results/row-kernels.md.

    python benchmarks/row_kernels.py [--reps 15] [--threads 2] [--dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hal
from forward import CTX, batch_decode, ours
from report import publish
from hal.models.fetch import fetch
from hal.models.llama import Llama
from hal.models.loaders import load_gguf
from hal.models.machine import machine_line

CASES = [("decode, 1 request", ours, 1), ("verify, 5 tokens", ours, 5), ("verify, 9 tokens", ours, 9),
         ("decode, 4 requests", batch_decode, 4), ("decode, 16 requests", batch_decode, 16)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/row-kernels.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fused = load_gguf(fetch("smollm2-135m"), hal.get_backend("cpu"), args.dtype)[0]
    eager = Llama(fused.cfg, fused.w, fused.be, plan=fused.plan, fused_rows=False)
    fns = {(name, kind): make(model, n) for name, make, n in CASES
           for kind, model in (("fused", fused), ("eager", eager))}
    outs = {key: fn() for key, fn in fns.items()}   # warm-up, and the logits compared below
    times = {key: [] for key in fns}
    for rep in range(args.reps):
        for key in (fns if rep % 2 else reversed(list(fns))):
            t = time.perf_counter()
            fns[key]()
            times[key].append(time.perf_counter() - t)
    med = {key: statistics.median(v) for key, v in times.items()}
    lines = ["# Fused row kernels against eager ATen ops (SmolLM2-135M, 200 cached tokens)", "",
             f"Command: `python benchmarks/row_kernels.py --reps {args.reps} --threads {args.threads} --dtype "
             f"{args.dtype}`; medians of {args.reps} interleaved runs, {time.strftime('%Y-%m-%d')}.", "",
             f"{machine_line(fused.plan, args.threads)}; row kernels: {fused.rows.describe}.", "",
             "| forward | eager ms | fused ms | fused / eager | max abs logit difference | greedy tokens agree |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, _, n in CASES:
        a, b = med[(name, "eager")], med[(name, "fused")]
        la, lb = outs[(name, "eager")][0], outs[(name, "fused")][0]
        agree = int((la.argmax(-1) == lb.argmax(-1)).sum())
        lines.append(f"| {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.3f} | {float((la - lb).abs().max()):.4f} | "
                     f"{agree}/{la.shape[0]} |")
    lines += ["", f"Each forward feeds its tokens after {CTX} cached ones (`benchmarks/forward.py`'s cases); the "
              "logits compared are each path's first forward of the case."]
    publish(lines, args.out)


if __name__ == "__main__":
    with torch.inference_mode():   # as the engine's steps run (`SpeculativeDecoder.step`)
        main()
