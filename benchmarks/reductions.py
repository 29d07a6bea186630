"""Torch's indexed reductions against `hal.reductions.first_max` on this CPU, side by side in one
run: ``argmax(-1)``, ``max(-1)`` and ``first_max`` of ``[R, V]`` float32 rows (V: the bundled
model's vocabulary), then the checked greedy verify of R - 1 drafts (`Backend.verify_greedy`) and
`Backend.greedy_rows`, which use it. Calls alternate round by round; medians of ``--reps``.

    python benchmarks/reductions.py [--rows 1,4,7,16] [--vocab 49152] [--reps 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from routing import publish  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,7,16")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import hal
    from hal.models.machine import machine_line
    from hal.reductions import first_max
    torch.set_num_threads(2)
    be = hal.get_backend("cpu")
    lines = [f"# Indexed reductions against first_max, {time.strftime('%Y-%m-%d')}", "",
             f"Command: `python benchmarks/reductions.py {' '.join(sys.argv[1:])}`. {machine_line()}, 2 threads. "
             f"Float32 rows of {args.vocab} columns; µs, medians of {args.reps} alternating calls.", "",
             "| rows | `argmax(-1)` | `max(-1)` | `first_max` | `Backend.verify_greedy` (rows - 1 drafts) | "
             "`Backend.greedy_rows` |", "|---|---|---|---|---|---|"]
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows))
            ids, cu = torch.arange(rows - 1), torch.tensor([0, rows - 1])
            calls = {"argmax": lambda: x.argmax(-1), "max": lambda: x.max(-1), "first_max": lambda: first_max(x),
                     "verify": lambda: be.verify_greedy(ids, cu, x, max(rows - 1, 0)),
                     "greedy_rows": lambda: be.greedy_rows(x)}
            t = {name: [] for name in calls}
            for _ in range(args.reps):
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    t[name].append(time.perf_counter() - t0)
            lines.append(f"| {rows} | " + " | ".join(f"{statistics.median(v) * 1e6:.0f}" for v in t.values()) + " |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
