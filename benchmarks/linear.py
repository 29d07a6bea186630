"""The Llama runner's linear layers at M = 1, 2, 5, 9, 17 fed tokens (SmolLM2-135M shapes:
30 layers of fused QKV, O, gate+up, down, plus the lm_head), fp32, side by side in one run:

* ``F.linear(x, W)`` (the runner today), ``torch.mm(W, x.T).T`` and ``x @ W_T`` (a transposed
  copy of the weights);
* for each, the largest difference between row i computed in the batch of M and the same row
  computed alone (M = 1): zero means batch-invariant.

    python benchmarks/linear.py [--reps 7] [--threads 2]

The first step of the model-drafting issue's part 1; nothing in the runner changes here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

H, FFN, V, LAYERS, HEADS, KV, D = 576, 1536, 49152, 30, 9, 3, 64
SHAPES = [((HEADS + 2 * KV) * D, H), (H, HEADS * D), (2 * FFN, H), (H, FFN)]   # per layer, [out, in]
MS = (1, 2, 5, 9, 17)


def layouts(ws):
    wt = [w.t().contiguous() for w in ws]
    return {"F.linear(x, W)": lambda x, i: F.linear(x, ws[i]),
            "mm(W, x.T).T": lambda x, i: torch.mm(ws[i], x.t()).t(),
            "x @ W_T": lambda x, i: x @ wt[i]}


def forward_cost(fn, ws, M, reps):
    x = [torch.randn(M, w.shape[1]) for w in ws]
    order = list(range(len(ws) - 1)) * LAYERS + [len(ws) - 1]   # every layer's four, then the lm_head
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in order:
            fn(x[i], i)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def invariance(fn, ws, M):
    """Max |row i in a batch of M - row i alone| over the layer shapes."""
    worst = 0.0
    g = torch.Generator().manual_seed(M)
    for i, w in enumerate(ws):
        x = torch.randn(M, w.shape[1], generator=g)
        batch = fn(x, i)
        alone = torch.cat([fn(x[r:r + 1], i) for r in range(M)])
        worst = max(worst, float((batch - alone).abs().max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "linear.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) * 0.02 for o, i in SHAPES] + [torch.randn(V, H, generator=g) * 0.02]
    fns = layouts(ws)
    for M in MS:   # warm-up: every kernel path once before anything is timed
        for fn in fns.values():
            forward_cost(fn, ws, M, 1)
    cost = {(name, M): forward_cost(fn, ws, M, args.reps) for M in MS for name, fn in fns.items()}  # interleaved
    inv = {(name, M): invariance(fn, ws, M) for M in MS if M > 1 for name, fn in fns.items()}
    lines = ["# Linear layers of the Llama runner at M fed tokens (SmolLM2-135M shapes, fp32)", "",
             f"Command: `python benchmarks/linear.py --reps {args.reps} --threads {args.threads}`; torch "
             f"{torch.__version__}, {args.threads} threads, medians of {args.reps}, {time.strftime('%Y-%m-%d')}. "
             "Time: the 30 layers' four linears plus the lm_head; cost(M) / cost(1) in brackets. "
             "Invariance: max |row in the batch - the row alone| (0 = batch-invariant).", "",
             "| layout | " + " | ".join(f"M = {M}" for M in MS) + " | invariance M = 2 / 5 / 9 / 17 |",
             "|---|" + "---|" * len(MS) + "---|"]
    for name in fns:
        c1 = cost[(name, 1)]
        cells = [f"{cost[(name, M)] * 1e3:.0f} ms ({cost[(name, M)] / c1:.2f})" for M in MS]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " | "
                     + " / ".join(f"{inv[(name, M)]:.1e}" for M in MS if M > 1) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
