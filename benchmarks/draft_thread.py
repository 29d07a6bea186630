"""A draft in the target's process: drafted inline every round, against the same drafter on its
own thread one round ahead (`hal.distributed.local.ThreadDrafter`, ``--draft-thread on``), on
SmolLM2-135M (GGUF Q4_1, the plan ``auto`` measures), greedy, a fixed k, the end-to-end
benchmark's prompts. The in-process form of issue 36's "the second device pays": the target at
one intra-op thread, and the draft thread at one more (on a 2-core CPU, each has a core).
Every mode's output must equal plain greedy (checked); tokens/s are medians of interleaved
runs. Writes benchmarks/results/draft-thread.md.

    python benchmarks/draft_thread.py [--drafts ngram,self:8,eagle] [--reps 3] [--max-new-tokens 64] [--push]

``--push``: each drafter also on its own thread with ``push`` (`hal.distributed.remote.RemoteDrafter`: the
thread offers its branches while the target verifies; a round whose outcome was offered waits for no reply).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.e2e import PROMPTS  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from hal.distributed.local import ThreadDrafter  # noqa: E402
from hal.drafters.kinds import make_drafter, parse_draft  # noqa: E402
from hal.engine import Request, SpeculativeDecoder  # noqa: E402
from hal.metrics import SpecDecodeMetrics  # noqa: E402
from hal.models.fetch import fetch  # noqa: E402
from hal.models.loaders import load_gguf  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402
from hal.models.tokenizer import chatml  # noqa: E402


def run(target, drafter, ids, n: int, k: int, metrics) -> tuple[list[int], float]:
    dec = SpeculativeDecoder(target, drafter, num_blocks=256, metrics=metrics)
    t = time.perf_counter()
    out = dec.generate([Request(ids, max_new_tokens=n, k=k if drafter is not None else 0, stop_ids=(2,))])[0]
    return out, time.perf_counter() - t


def once(target, kind: str | None, threaded: bool, ids, args, push: bool = False
         ) -> tuple[list[int], float, SpecDecodeMetrics]:
    """One generation with a fresh drafter (inline, or on its own thread, with push or not); its
    output, seconds, metrics."""
    metrics = SpecDecodeMetrics()
    drafter = None if kind is None else make_drafter(parse_draft(kind), target.be, target, "smollm2-135m")
    if threaded:
        drafter = ThreadDrafter(drafter, target.cfg.vocab, target.device, metrics, fanout=args.fanout, push=push)
    try:
        out, dt = run(target, drafter, ids, args.max_new_tokens, args.k, metrics)
    finally:
        if threaded:
            drafter.close()
    return out, dt, metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="ngram,self:8,eagle")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--fanout", type=int, default=8, help="branches drafted ahead per round on the thread")
    ap.add_argument("--push", action="store_true", help="also each drafter on its own thread with push")
    ap.add_argument("--out", default="benchmarks/results/draft-thread.md")
    args = ap.parse_args()
    torch.set_num_threads(1)   # the target's core; the draft thread's ops run at one thread on the other
    be = hal.get_backend("cpu")
    target, tok = load_gguf(fetch("smollm2-135m"), be, "auto")
    kinds = args.drafts.split(",")
    modes = [(None, False, False)] + [(kind, t, p) for kind in kinds for t, p in
                                      ((False, False), (True, False)) + (((True, True),) if args.push else ())]
    rows = []
    with torch.inference_mode():
        for label, _, text in PROMPTS:
            ids = tok.encode(chatml(text)).ids
            plain = once(target, None, False, ids, args)[0]
            times = {m: [] for m in modes}
            seen = {}
            for rep in range(args.reps + 1):   # the first round warms up, untimed
                for mode in modes:
                    out, dt, metrics = once(target, mode[0], mode[1], ids, args, mode[2])
                    if out != plain:
                        raise SystemExit(f"{label}: {mode} differs from plain greedy output")
                    if rep:
                        times[mode].append(len(out) / dt)
                        seen[mode] = metrics
            rows.append((label, {m: statistics.median(v) for m, v in times.items()}, seen))
    publish(table(rows, kinds, args), args.out)


def table(rows, kinds: list[str], args) -> list[str]:
    lines = ["# A draft in the target's process: inline against its own thread, one round ahead", "",
             f"Command: `python benchmarks/draft_thread.py --drafts {','.join(kinds)} --reps {args.reps} "
             f"--max-new-tokens {args.max_new_tokens} --k {args.k} --fanout {args.fanout}"
             f"{' --push' if args.push else ''}`; "
             f"{time.strftime('%Y-%m-%d')}; {machine_line()}; one intra-op thread for the target (and one "
             f"for the draft thread); greedy, fixed k; outputs equal plain greedy in every mode (checked). "
             f"tok/s, medians of {args.reps} interleaved runs; hits: rounds answered from the speculation cache.", "",
             "| prompt | plain | " + " | ".join(f"{k} inline | {k} thread | thread / inline | {k} hits"
                                               + (f" | {k} thread push | push / inline | {k} rounds pushed"
                                                  if args.push else "") for k in kinds) + " |",
             "|---|---:|" + ("---:|---:|---:|---:|" + "---:|---:|---:|" * args.push) * len(kinds)]
    for label, t, seen in rows:
        cells = [f"{t[(None, False, False)]:.1f}"]
        for k in kinds:
            a, b, m = t[(k, False, False)], t[(k, True, False)], seen[(k, True, False)]
            rate = m.spec_cache_hits / max(1, m.spec_cache_hits + m.spec_cache_misses)
            cells += [f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}", f"{rate:.0%}"]
            if args.push:
                c, m = t[(k, True, True)], seen[(k, True, True)]
                cells += [f"{c:.1f}", f"{c / a:.2f}", f"{m.pushed_rounds}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
