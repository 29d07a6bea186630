"""How fast the q4q8 kernel streams a decode's weights, by row length K (not in ``make test``).

One row (a decode) times random weights of N x K with N·K fixed (16.8M weights, N = 2^24 / K),
eight such weights in turn so that they stream from memory, not the caches: their stored
bytes over the least time of ``--reps`` passes, in GB/s, per tile kind (Q4_0 as stored: Q40
tiles; Q4_K; Q6_K) and thread count. A decode is bound by the weights' bytes, so this rate
is the kernel's decode speed; where it falls with K, the row's own codes are what the tiles
stall on. ``--checkout`` times another checkout's kernel (its ``hal`` imported instead of
this one's), for a before and after.

    python benchmarks/q4q8_stream.py [--threads 1,2] [--reps 4] [--checkout PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def weights(q4_rows, int4, kind: str, N: int, K: int, g):
    import torch
    if kind == "Q4_0":   # m = -8·d: Q40 tiles where the checkout has them, else Q4 tiles
        b = q4_rows.random(N, K, g)
        return q4_rows.pack(int4.Int4Blocks(b.codes, b.scales, torch.zeros_like(b.scales)), torch.bfloat16)
    return (q4_rows.random_q4k if kind == "Q4_K" else q4_rows.random_q6k)(N, K, g, torch.bfloat16)


def commit(checkout: Path) -> str:
    """The checkout's commit (short), with "+ changes" where its tree differs from it."""
    run = lambda *a: subprocess.run(["git", *a], cwd=checkout, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return run("rev-parse", "--short", "HEAD") + (" + changes" if run("status", "--porcelain", "--untracked-files=no") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kinds", default="Q4_0,Q4_K,Q6_K")
    ap.add_argument("--ks", default="1024,2048,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--checkout", default=str(ROOT), help="the checkout whose kernel is timed")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "q4q8_stream.md"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.checkout).resolve()))
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import torch
    from hal.models import int4, q4_rows
    from hal.models.machine import machine_line
    from report import publish
    assert Path(q4_rows.__file__).resolve().is_relative_to(Path(args.checkout).resolve()), q4_rows.__file__
    ks = [int(k) for k in args.ks.split(",")]
    rows = []
    for kind in args.kinds.split(","):
        for K in ks:
            if kind != "Q4_0" and K % 256:
                continue
            g = torch.Generator().manual_seed(0)
            ws = [weights(q4_rows, int4, kind, (1 << 24) // K, K, g) for _ in range(8)]
            x = torch.randn(1, K, dtype=torch.bfloat16)
            cells = []
            for th in [int(t) for t in args.threads.split(",")]:
                torch.set_num_threads(th)
                best = float("inf")
                for _ in range(args.reps):
                    t = time.perf_counter()
                    for w in ws:
                        w.mm(x)
                    best = min(best, time.perf_counter() - t)
                cells.append(f"{sum(w.nbytes for w in ws) / best / 1e9:.1f} ({8 * (1 << 24) / best / 1e9:.1f})")
            bits = ws[0].nbytes * 8 / (1 << 24)
            rows.append(f"| {kind} | {K} | {(1 << 24) // K} | {bits:.3f} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    head = " | ".join(f"GB/s (G weights/s), {t} thread{'s' if t != '1' else ''}" for t in args.threads.split(","))
    publish(["# The q4q8 kernel's decode streaming rate by row length", "",
             f"`python benchmarks/q4q8_stream.py --threads {args.threads} --kinds {args.kinds} --ks {args.ks} "
             f"--reps {args.reps}`", "", machine_line(), "",
             f"Checkout: {commit(Path(args.checkout))}. One bfloat16 row times 8 weights of N x K in turn (16.8M weights each), "
             f"stored bytes (and weights) over the least time of {args.reps} passes.", "",
             f"| kind | K | N | bits a weight | {head} |", "|---|---|---|---|" + "---|" * len(args.threads.split(",")),
             *rows], Path(args.out))


if __name__ == "__main__":
    main()
