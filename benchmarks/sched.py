"""Routing and adaptive k on SmolLM2-135M (greedy), side by side in one run.

1. Per prompt (the prompts of benchmarks/e2e.py): plain decoding, n-gram with fixed k,
   and n-gram with the router (k <= the fixed k, chosen per request and step). Runs are
   interleaved over ``--reps`` rounds; the median is reported.
2. Throughput against batch size (batches cycle through the same prompts): plain, fixed
   k, fixed k switched off above a batch size (vLLM's ``disable_by_batch_size``), routed.

    python benchmarks/sched.py [--max-new-tokens 64] [--k 8] [--reps 3] [--batches 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import hal
from hal.models.machine import machine_line
from hal.engine import Request, SpeculativeDecoder
from hal.engine.requests import draft_room
from hal.drafters import NgramDrafter
from hal.models.fetch import fetch
from hal.models.loaders import load_gguf
from hal.models.tokenizer import chatml
from hal.engine.router import Router

from e2e import PROMPTS  # noqa: E402  (benchmarks/ is the script's folder)


class BatchThreshold:
    """vLLM-style: fixed k, no speculation once the batch is larger than ``threshold``."""

    def __init__(self, k: int, threshold: int):
        self.k, self.threshold = k, threshold

    def choose(self, states, budget=None):
        return [min(self.k, draft_room(s)) if len(states) <= self.threshold else 0
                for s in states]

    def observe(self, *a):
        pass

    def release(self, s):
        pass


def run(target, ids_list, n, k, policy=None):
    drafter = NgramDrafter(target.be) if k else None
    dec = SpeculativeDecoder(target, drafter, num_blocks=64 * len(ids_list) + 64, router=policy)
    reqs = [Request(ids, max_new_tokens=n, k=k, stop_ids=(2,)) for ids in ids_list]
    t = time.perf_counter()
    out = dec.generate(reqs)
    target.be.synchronize()
    return out, time.perf_counter() - t, dec.metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--threshold", type=int, default=4, help="batch size above which the vLLM-style baseline stops")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sched.md"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = ap.parse_args()
    be = hal.get_backend("cpu")
    target, tok = load_gguf(fetch("smollm2-135m"), be, args.dtype)
    ids = [tok.encode(chatml(p)).ids for _, _, p in PROMPTS]
    n, K = args.max_new_tokens, args.k
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    probe = SpeculativeDecoder(target, NgramDrafter(be), num_blocks=64)
    costs = probe.profile_costs(max_tokens=max(batches) * (K + 1))
    profile_s = time.perf_counter() - t0
    lines = ["# Routing and adaptive k (SmolLM2-135M-Instruct, greedy, cpu backend)\n",
             f"Command: `python benchmarks/sched.py --max-new-tokens {n} --k {K} --reps {args.reps} "
             f"--batches {args.batches}`; {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')}; {machine_line(target.plan)}. Cost table profiled at start-up in "
             f"{profile_s:.1f} s: target forward "
             + ", ".join(f"{t} tok {c * 1e3:.1f} ms" for t, c in sorted(costs.verify.items()))
             + f"; attention {costs.per_context * 1e6:.2f} us per fed x context token; n-gram draft "
             + ", ".join(f"k={k} {c * 1e3:.2f} ms" for k, c in sorted(costs.draft.items())) + ".\n",
             "## Per prompt (median of interleaved reps)\n",
             "| prompt | system | tokens | tok/s | vs plain | acceptance | mean acc. length | mean drafts per verify | same as plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    systems = [("plain", 0, lambda: None), (f"n-gram k={K}", K, lambda: None),
               (f"n-gram routed k<={K}", K, lambda: Router(costs, max_k=K))]
    for (label, _, _), x in zip(PROMPTS, ids):
        times = {s: [] for s, _, _ in systems}
        outs, mets = {}, {}
        for _ in range(args.reps):
            for s, k, pol in systems:
                out, dt, m = run(target, [x], n, k, pol())
                times[s].append(dt)
                outs[s], mets[s] = out, m
        plain_tps = len(outs["plain"][0]) / statistics.median(times["plain"])
        for s, k, _ in systems:
            m, tps = mets[s], len(outs[s][0]) / statistics.median(times[s])
            t = m.total
            mean_k = t.num_draft_tokens / max(1, len(m.acceptance_lengths)) if k else 0
            lines.append(f"| {label} | {s} | {len(outs[s][0])} | {tps:.1f} | {tps / plain_tps:.3f}x | "
                         + (f"{m.acceptance_rate:.2f} | {m.mean_acceptance_length:.2f} | {mean_k:.1f}" if k else " | | ")
                         + f" | {'yes' if outs[s] == outs['plain'] else 'NO'} |")
            print(lines[-1], flush=True)
    lines += ["", "## Throughput against batch size (tokens/s over the whole batch; prompts cycle through the set)\n",
              f"| batch | plain | n-gram k={K} | k={K}, off above batch {args.threshold} (vLLM-style) | routed k<={K} "
              "| routed vs plain | routed mean drafts per verify | same as plain |",
              "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b in batches:
        xs = [ids[i % len(ids)] for i in range(b)]
        res = {}
        for s, k, pol in [("plain", 0, None), ("fixed", K, None), ("threshold", K, BatchThreshold(K, args.threshold)),
                          ("routed", K, Router(costs, max_k=K))]:
            out, dt, m = run(target, xs, n, k, pol)
            res[s] = (out, sum(map(len, out)) / dt, m)
        m = res["routed"][2]
        mean_k = m.total.num_draft_tokens / max(1, len(m.acceptance_lengths))
        same = all(res[s][0] == res["plain"][0] for s in res)
        lines.append(f"| {b} | {res['plain'][1]:.1f} | {res['fixed'][1]:.1f} | {res['threshold'][1]:.1f} | "
                     f"{res['routed'][1]:.1f} | {res['routed'][1] / res['plain'][1]:.2f}x | {mean_k:.1f} | "
                     f"{'yes' if same else 'NO'} |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
