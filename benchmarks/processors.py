"""Logits processors' cost in verification: penalties (frequency, presence, repetition) +
bad words + top-p, on R = 64 requests with k = 5 drafts each over V = 49152 (SmolLM2's
vocabulary), against the same verification without processors. Both paths are what the
engine runs (`hal.engine.forward.target_probs` + `verify_rejection`, and before it
`process_logits`), timed alternately in one run; the ratio of medians is reported.

    python benchmarks/processors.py [--reps 15] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import hal
from report import publish
from hal.engine.forward import target_probs
from hal.models.machine import machine_line

OUT = Path(__file__).parent / "results" / "processors.md"


def case(R: int, k: int, V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N = R * k
    logits = torch.randn(N + R, V, generator=g) * 4
    ids = torch.randint(0, V, (N,), generator=g)
    cu = torch.arange(R + 1) * k
    generated = torch.randint(0, V, (R, 200), generator=g)
    counts = torch.stack([torch.bincount(row, minlength=V) for row in generated]).int()
    prompt = torch.zeros(R, V, dtype=torch.bool)
    prompt[torch.arange(R)[:, None], torch.randint(0, V, (R, 300), generator=g)] = True
    words = torch.full((4 * R, 3), -1, dtype=torch.long)
    for w in range(4 * R):
        n = 1 + w % 3
        words[w, 3 - n:] = torch.randint(0, V, (n,), generator=g)
    procs = dict(penalties=torch.tensor([[0.5, 0.3, 1.2]] * R), token_counts=counts, prompt_mask=prompt, bias=None,
                 bad_words=words, bad_word_owner=torch.arange(4 * R) // 4, history=generated[:, -2:], stop_ids=None,
                 min_tokens=None, min_p=None)
    temp, top_k, top_p = torch.full((k * R + R,), 0.8), torch.zeros(k * R + R, dtype=torch.int32), \
        torch.full((k * R + R,), 0.9)
    return logits, ids, cu, procs, (temp, top_k, top_p), torch.arange(R), torch.zeros(R, dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    be = hal.get_backend("cpu")
    R, k, V = 64, 5, 49152
    logits, ids, cu, procs, (temp, top_k, top_p), seeds, offsets = case(R, k, V)

    class P:   # host-known sampling parameters (no readback for the sort width)
        top_k, top_p = 0, 0.9
    params = [P()] * (R * k + R)

    def verify(rows):
        p = target_probs(rows, temp, top_k, top_p, params)
        return be.verify_rejection(ids, cu, None, p, seeds, offsets, k)

    def plain():
        return verify(logits)

    def processed():
        return verify(be.process_logits(logits, ids, cu, None, **procs, max_k=k))
    times = {"plain": [], "processed": []}
    for fn in (plain, processed):
        fn()
    for _ in range(args.reps):
        for name, fn in (("plain", plain), ("processed", processed)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) for n, v in times.items()}
    lines = ["# Logits processors in verification", "",
             f"`python benchmarks/processors.py --reps {args.reps}`; {machine_line(threads=args.threads)}.", "",
             f"R = {R} requests, k = {k} drafts each, V = {V}; top-p 0.9 at T 0.8 on both paths; the processed path "
             "adds frequency + presence + repetition penalties (each request with 200 generated and 300 prompt "
             "tokens) and 4 bad words per request (1 to 3 tokens). Median of "
             f"{args.reps} alternating runs, argument checks included (the cpu backend runs its value checks always, as in the engine).", "",
             "| path | ms per verification | ratio |", "|---|---:|---:|",
             f"| plain (top-p + rejection) | {med['plain'] * 1e3:.1f} | 1.00 |",
             f"| + process_logits (penalties, bad words) | {med['processed'] * 1e3:.1f} | "
             f"{med['processed'] / med['plain']:.2f} |", "",
             "Target: at most 1.3x."]
    publish(lines, OUT)


if __name__ == "__main__":
    main()
