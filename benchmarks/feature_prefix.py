"""Prefix caching with a drafter that reads the target's features (`hal.engine.feature_cache`):
chat requests sharing a system turn, one at a time, each drafter's engine with the cache on and
off, interleaved request by request in one process (a busy spell lands on both). Greedy; the
outputs must be equal (the run stops otherwise). Reported per drafter: time to first token
and to the last, medians over the requests after the first (the first fills the cache), the
prompt tokens found in the cache, and tokens per step with each.

    python benchmarks/feature_prefix.py [--drafts eagle,dspark] [--requests 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from defaults import OPEN  # noqa: E402
from load import SYSTEM  # noqa: E402

import hal  # noqa: E402
from hal.drafters.kinds import make_drafter, parse_draft  # noqa: E402
from hal.engine.requests import Request  # noqa: E402
from hal.launch.build import build_engine  # noqa: E402
from hal.models.fetch import load_model  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402
from hal.models.tokenizer import chatml  # noqa: E402


def timed(dec, ids: list[int], max_tokens: int, stop) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, seconds to the last) of one request alone."""
    t0, first = time.perf_counter(), None
    rid = dec.add(Request(ids, max_new_tokens=max_tokens, k=7, stop_ids=stop))
    out: list[int] = []
    while dec.has_unfinished():
        got = dec.step().tokens.get(rid, [])
        if got and first is None:
            first = time.perf_counter() - t0
        out += got
    return out, first, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="eagle,dspark")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/feature-prefix.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    stop = target.cfg.stop_ids
    prompts = [tok.encode(chatml(f"Question {i}: {OPEN[i % len(OPEN)]}", SYSTEM)).ids for i in range(args.requests)]
    lines = ["# Prefix caching with a feature-reading drafter: a shared system turn, cache on and off", "",
             f"`python benchmarks/feature_prefix.py {' '.join(sys.argv[1:])}`; {machine_line(target.plan)}; "
             f"{time.strftime('%Y-%m-%d')}. {args.requests} requests one at a time, prompts of "
             f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens sharing a system turn, greedy, "
             f"{args.max_tokens} tokens each, k = 7; medians over requests 2 to {args.requests}.", "",
             "| drafter | prefix caching | TTFT (s) | end to end (s) | prompt tokens from the cache | tokens/step |",
             "|---|---|---:|---:|---:|---:|"]
    for name in args.drafts.split(","):
        decs = {on: build_engine(target, make_drafter(parse_draft(name), target.be, target, "smollm2-135m"), k=7,
                                 enable_prefix_caching=on) for on in (True, False)}
        times: dict = {True: [], False: []}
        for i, ids in enumerate(prompts):
            outs = {on: timed(dec, ids, args.max_tokens, stop) for on, dec in decs.items()}
            if outs[True][0] != outs[False][0]:
                raise SystemExit(f"{name}: request {i}: outputs differ with the cache on and off")
            if i:
                for on in decs:
                    times[on].append(outs[on][1:])
        for on, dec in decs.items():
            ttft, e2e = (statistics.median(t[j] for t in times[on]) for j in (0, 1))
            m = dec.metrics.total
            lines.append(f"| {name} | {'on' if on else 'off'} | {ttft:.3f} | {e2e:.2f} | {dec.prefix_cache_stats[1]} "
                         f"of {dec.prefix_cache_stats[0]} | {m.mean_acceptance_length:.2f} |")
        print("\n".join(lines[-2:]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
