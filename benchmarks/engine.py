"""Continuous batching against static batching on a stream of requests (SmolLM2-135M, greedy,
n-gram drafts), side by side in one run, on the same arrival schedule.

* static: today's `generate` on whatever has arrived, run to the end before the next batch;
* continuous: `add_request` on arrival, one `step` at a time, under each
  ``max_num_batched_tokens`` of ``--budgets`` (none = unbounded).

Requests cycle through the prompts of benchmarks/e2e.py (three copy-heavy, one open-ended)
with lengths cycling through ``--lengths``; arrivals are Poisson at ``--rate`` per second
(seeded). Reported: throughput (generated tokens / seconds from the first arrival to the
last token), TTFT and TPOT P50/P99, and whether every output equals the static run's.

    python benchmarks/engine.py [--requests 32] [--rate 3] [--k 4] [--budgets none,256,64] [--repeat 3] [--route]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

import hal
from hal.models.machine import machine_line
from hal.engine import Request, SamplingParams, SpeculativeDecoder
from hal.drafters import NgramDrafter
from hal.metrics import percentile
from hal.models.fetch import fetch
from hal.models.loaders import load_gguf
from hal.models.tokenizer import chatml

from e2e import PROMPTS  # noqa: E402  (benchmarks/ is the script's folder)


class Clock:
    """Token timestamps per request, against its arrival."""

    def __init__(self, arrivals: list[float]):
        self.t0, self.arrivals = time.perf_counter(), arrivals
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_for(self, t: float) -> None:
        if (d := t - self.now()) > 0:
            time.sleep(d)

    def tokens(self, i: int, n: int) -> None:
        if n:
            t = self.now()
            self.first.setdefault(i, t)
            self.last[i] = t
            self.count[i] = self.count.get(i, 0) + n

    def summary(self) -> dict:
        ttft = [self.first[i] - self.arrivals[i] for i in self.first]
        tpot = [(self.last[i] - self.first[i]) / (self.count[i] - 1) for i in self.first if self.count[i] > 1]
        span = max(self.last.values()) - min(self.arrivals)
        return dict(tok_s=sum(self.count.values()) / span, span=span, ttft50=percentile(ttft, 50),
                    ttft99=percentile(ttft, 99), tpot50=percentile(tpot, 50), tpot99=percentile(tpot, 99))


def run_static(target, be, reqs, arrivals, k, router=None):
    clock, outs, i = Clock(arrivals), {}, 0
    while i < len(reqs):
        clock.wait_for(arrivals[i])
        j = i
        while j < len(reqs) and arrivals[j] <= clock.now():
            j += 1
        batch = list(range(i, j))
        dec = SpeculativeDecoder(target, NgramDrafter(be), num_blocks=64 * len(batch) + 64,
                                 on_tokens=lambda rid, new, b=batch: clock.tokens(b[rid], len(new)),
                                 router=router and router())
        for n, o in zip(batch, dec.generate([reqs[n] for n in batch])):
            outs[n] = o
        i = j
    target.be.synchronize()
    return outs, clock.summary()


def run_continuous(target, be, reqs, arrivals, k, budget, max_seqs, num_blocks, router=None):
    clock, outs, i, ids = Clock(arrivals), {}, 0, {}
    dec = SpeculativeDecoder(target, NgramDrafter(be), num_blocks=num_blocks, max_num_batched_tokens=budget,
                             max_num_seqs=max_seqs, router=router and router())
    while len(outs) < len(reqs) or dec.has_unfinished():
        while i < len(reqs) and arrivals[i] <= clock.now():
            r = reqs[i]
            ids[dec.add_request(r.prompt_ids, SamplingParams(max_new_tokens=r.max_new_tokens, k=r.k,
                                                             stop_ids=r.stop_ids))] = i
            outs.setdefault(i, [])
            i += 1
        if not dec.has_unfinished():
            clock.wait_for(arrivals[i])
            continue
        step = dec.step()
        for rid, new in step.tokens.items():
            outs[ids[rid]] += new
            clock.tokens(ids[rid], len(new))
    target.be.synchronize()
    return outs, clock.summary(), dec.preemptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=3.0, help="arrivals per second (Poisson)")
    ap.add_argument("--lengths", default="16,48,24,64", help="max_new_tokens, cycled")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budgets", default="none,256,64", help="max_num_batched_tokens values (none: unbounded)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of every engine, interleaved (medians)")
    ap.add_argument("--route", action="store_true", help="every engine routed (k per request and step, cap --k)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.md"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = ap.parse_args()
    torch.manual_seed(0)
    be = hal.get_backend("cpu")
    target, tok = load_gguf(fetch("smollm2-135m"), be, args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = [tok.encode(chatml(p)).ids for _, _, p in PROMPTS]
    reqs = [Request(ids[i % len(ids)], max_new_tokens=lengths[i % len(lengths)], k=args.k, stop_ids=(2,))
            for i in range(args.requests)]
    rng, t, arrivals = random.Random(0), 0.0, []
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    budgets = [None if b == "none" else int(b) for b in args.budgets.split(",")]
    router = None
    if args.route:   # the same measured costs for every engine; a fresh router per decoder
        from hal.engine.router import Router
        costs = SpeculativeDecoder(target, NgramDrafter(be), num_blocks=256).profile_costs()
        router = lambda: Router(costs, max_k=args.k)  # noqa: E731
    runs: dict[str, list] = {}   # engine -> [(summary, same output, preemptions)] per repetition
    ref = None
    for _ in range(args.repeat):  # interleaved: every engine once per repetition, on the same schedule
        outs, s = run_static(target, be, reqs, arrivals, args.k, router)
        ref = ref or outs
        runs.setdefault("static `generate` per arrived batch", []).append((s, outs == ref, 0))
        for b in budgets:
            outs, s, pre = run_continuous(target, be, reqs, arrivals, args.k, b, args.max_num_seqs, args.num_blocks,
                                          router)
            runs.setdefault(f"continuous, max_num_batched_tokens={b or 'none'}", []).append((s, outs == ref, pre))
    base = [s["tok_s"] for s, _, _ in next(iter(runs.values()))]
    rows = []
    for name, rs in runs.items():   # the median of each figure; "vs static": the median per-repetition ratio
        med = {key: statistics.median(s[key] for s, _, _ in rs) for key in rs[0][0]}
        med["ratio"] = statistics.median(s["tok_s"] / b for (s, _, _), b in zip(rs, base))
        rows.append((name, med, all(same for _, same, _ in rs), max(pre for _, _, pre in rs)))
    argv = __import__("sys").argv[1:]
    cmd = "python benchmarks/engine.py " + " ".join(a for i, a in enumerate(argv)
                                                    if a != "--out" and (i == 0 or argv[i - 1] != "--out"))
    lines = ["# Continuous vs static batching (SmolLM2-135M-Instruct, greedy, n-gram "
             f"{'routed, k <= ' if args.route else 'k='}{args.k}, cpu backend)", "",
             f"Command: `{cmd.strip()}`; {args.requests} requests, Poisson arrivals at {args.rate}/s over "
             f"{arrivals[-1]:.1f} s, max_new_tokens cycling {lengths}; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}; {machine_line(target.plan)}. One run, "
             f"same schedule; every engine "
             f"{args.repeat} times, interleaved; medians (vs static: the median of the per-repetition ratios).", "",
             "| engine | tok/s | vs static | TTFT P50 / P99 (s) | TPOT P50 / P99 (ms) | outputs = static | preemptions |",
             "|---|---|---|---|---|---|---|"]
    for name, s, same, pre in rows:
        lines.append(f"| {name} | {s['tok_s']:.1f} | {s['ratio']:.2f}x | {s['ttft50']:.2f} / "
                     f"{s['ttft99']:.2f} | {s['tpot50'] * 1e3:.0f} / {s['tpot99'] * 1e3:.0f} | "
                     f"{'yes' if same else 'NO'} | {pre} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = ["static"] + [f"cont. {b or 'none'}" for b in budgets]
        fig, (a, c) = plt.subplots(1, 2, figsize=(10, 3.6))
        a.bar(names, [r[1]["tok_s"] for r in rows], color=["gray"] + ["tab:blue"] * len(budgets))
        a.set_ylabel("generated tok/s")
        a.set_title("throughput on a staggered stream")
        x = range(len(rows))
        c.bar([i - 0.2 for i in x], [r[1]["tpot50"] * 1e3 for r in rows], 0.4, label="P50")
        c.bar([i + 0.2 for i in x], [r[1]["tpot99"] * 1e3 for r in rows], 0.4, label="P99")
        c.set_xticks(list(x), names)
        c.set_ylabel("TPOT (ms)")
        c.set_title("time per output token")
        c.legend()
        for ax in (a, c):
            ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=100)
    except ImportError:
        print("matplotlib not installed: no PNG")


if __name__ == "__main__":
    main()
