"""The fused row kernels and the native layer loop against eager ATen ops, side by side
(SmolLM2-135M, GGUF Q4_1, 200 cached tokens, the plan this machine chose): the same model and
weights with ``fused_rows=False`` (`hal.models.invariant`'s ATen attention and the eager
steps), with the fused row kernels and the Python layer loop (``native_loop=False``), and
with both (the default: `hal.models.layer_loop` where the plan runs int4), interleaved in one
run (medians), for a one-token decode, verifies of 5 and 9 tokens, and batched decodes of 4
and 16 requests. Also how far the eager and fused logits are apart (they sum in different
orders), whether their greedy tokens agree, and whether the two fused loops' logits are
bit-identical. Writes benchmarks/results/row-kernels.md.

    python benchmarks/row_kernels.py [--reps 15] [--threads 2] [--dtype auto]

With ``HAL_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2`` it measures the code an AVX2-only CPU
runs (our kernels built for it, ATen's AVX2 kernels), on this CPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import hal
from forward import CASES, CTX, interleaved
from report import publish
from hal.models.fetch import fetch
from hal.models.llama import Llama
from hal.models.loaders import load_gguf
from hal.models.machine import machine_line

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
    python = Llama(fused.cfg, fused.w, fused.be, plan=fused.plan, native_loop=False)
    fns = {(name, kind): make(model, n) for name, make, n in CASES
           for kind, model in (("native", fused), ("fused", python), ("eager", eager))}
    outs = {key: fn() for key, fn in fns.items()}   # warm-up, and the logits compared below
    med = interleaved(fns, args.reps)
    env = "".join(f"{k}={os.environ[k]} " for k in ("HAL_MARCH", "ATEN_CPU_CAPABILITY") if os.environ.get(k))
    lines = ["# Fused row kernels and the native layer loop against eager ATen ops (SmolLM2-135M, 200 cached "
             "tokens)", "",
             f"Command: `{env}python benchmarks/row_kernels.py --reps {args.reps} --threads {args.threads} --dtype "
             f"{args.dtype}`; medians of {args.reps} interleaved runs, {time.strftime('%Y-%m-%d')}.", "",
             f"{machine_line(fused.plan, args.threads)}; row kernels: {fused.rows.describe}; native layer loop: "
             f"{'yes' if fused.loop is not None else 'no (it does not apply or did not build)'}.", "",
             "| forward | eager ms | fused ms | fused + native loop ms | fused / eager | native / fused | "
             "native / eager | max abs logit difference | greedy tokens agree | native = fused bits |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, _, n in CASES:
        a, b, c = med[(name, "eager")], med[(name, "fused")], med[(name, "native")]
        la, lb, lc = outs[(name, "eager")][0], outs[(name, "fused")][0], outs[(name, "native")][0]
        agree = int((la.argmax(-1) == lb.argmax(-1)).sum())
        lines.append(f"| {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {c * 1e3:.2f} | {b / a:.3f} | {c / b:.3f} | "
                     f"{c / a:.3f} | {float((la - lb).abs().max()):.4f} | {agree}/{la.shape[0]} | "
                     f"{'yes' if torch.equal(lb, lc) else 'NO'} |")
    lines += ["", f"Each forward feeds its tokens after {CTX} cached ones (`benchmarks/forward.py`'s cases); the "
              "logits compared are each path's first forward of the case."]
    publish(lines, args.out)


if __name__ == "__main__":
    with torch.inference_mode():   # as the engine's steps run (`SpeculativeDecoder.step`)
        main()
