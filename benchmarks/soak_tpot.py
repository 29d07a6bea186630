"""TPOT under the soak mix with the draft on a second rank against the draft in the target's
process (issue 36's P99 target): `benchmarks/soak.py`'s traffic (chat and completions,
streaming or not, ``n = 2``, JSON schemas, a shared system turn, clients that leave) at
``--rate`` requests/s for ``--minutes`` per run, no worker kill, against `spec-hal serve` with
n-gram drafts (k = 4, routed) on a draft rank (torch.distributed, gloo on 127.0.0.1) and then
the same server alone (world 1: the drafter in its process). The placements alternate run by
run (ABBA over ``--rounds`` pairs), each run on a fresh server with the same traffic seed.
TPOT is measured by the client on streamed single-choice answers of two or more tokens: first
to last chunk with text, over the tokens the answer's usage counts, less one.

    python benchmarks/soak_tpot.py [--minutes 4] [--rate 1.5] [--rounds 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from load import free_port, stop, wait_up  # noqa: E402
from report import publish  # noqa: E402
from soak import launch, traffic  # noqa: E402

from hal.metrics import percentile  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402

OUT = Path(__file__).parent / "results" / "soak-tpot.md"
PLACEMENTS = {"draft rank": 2, "in-process": 1}   # name -> world size


def run(world: int, args) -> tuple[list[float], dict]:
    """One fresh server of ``world`` ranks under the traffic: (TPOTs in seconds, answer counts)."""
    port = free_port()
    procs, _ = launch(port, world, log_path=f"/tmp/hal-soak-tpot-{world}.log")
    base, tpots = f"http://127.0.0.1:{port}", []
    try:
        wait_up(base, list(procs.values()))
        counts = asyncio.run(traffic(base, args.minutes, args.rate, args.seed, procs, 2.0, [], None, tpots=tpots))
    finally:
        stop(list(procs.values()))
    return tpots, dict(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--rate", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    order = [name for r in range(args.rounds) for name in (list(PLACEMENTS) if r % 2 == 0 else list(PLACEMENTS)[::-1])]
    rows, pooled = [], {name: [] for name in PLACEMENTS}
    for i, name in enumerate(order):
        tpots, counts = run(PLACEMENTS[name], args)
        pooled[name] += tpots
        rows.append((i + 1, name, tpots, counts))
        print(name, len(tpots), counts, flush=True)
    lines = ["# TPOT under the soak mix: the draft on a second rank against the draft in-process", "",
             f"Command: `python benchmarks/soak_tpot.py --minutes {args.minutes:g} --rate {args.rate:g} --rounds "
             f"{args.rounds} --seed {args.seed}`; {time.strftime('%Y-%m-%d')}; {machine_line()}; both ranks on this "
             "host. n-gram drafts, k = 4 routed; TPOT from the client (streamed single-choice answers).", "",
             "| run | placement | answers timed | TPOT P50 (ms) | TPOT P99 (ms) | answers |",
             "|---:|---|---:|---:|---:|---|"]
    for i, name, tpots, counts in rows:
        p50, p99 = (percentile(tpots, 50) * 1e3, percentile(tpots, 99) * 1e3) if tpots else (float("nan"),) * 2
        lines.append(f"| {i} | {name} | {len(tpots)} | {p50:.1f} | {p99:.1f} | {counts} |")
    remote, local = pooled["draft rank"], pooled["in-process"]
    if remote and local:
        r99, l99 = percentile(remote, 99), percentile(local, 99)
        lines += ["", f"Pooled: P50 {percentile(remote, 50) * 1e3:.1f} against {percentile(local, 50) * 1e3:.1f} ms, "
                  f"**P99 {r99 * 1e3:.1f} against {l99 * 1e3:.1f} ms** (draft rank / in-process "
                  f"{r99 / l99:.2f}x; the target is at most 1.00x); mean "
                  f"{statistics.mean(remote) * 1e3:.1f} against {statistics.mean(local) * 1e3:.1f} ms."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
