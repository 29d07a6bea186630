"""The two-rank path's cost: `python -m hal.launch` with the draft worker on another rank (torchrun,
gloo) against the same command in one process, interleaved. torchrun gives each rank one
thread, so the one-process run gets OMP_NUM_THREADS=1 too. Writes a markdown table.

    python benchmarks/serve.py [--draft ngram] [--k 8] [--max-tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from e2e import CODE  # noqa: E402  (benchmarks/ is the script's folder)

PROMPT = f"Rename the variable `parts` to `fields` in this code and output the whole code:\n\n{CODE}"


def serve(two_ranks: bool, args) -> dict:
    out = Path(tempfile.mkdtemp()) / "o.json"
    cmd = ["-m", "hal.launch", "--draft", args.draft, "--k", str(args.k), "--max-tokens", str(args.max_tokens),
           "--prompt", PROMPT, "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    if two_ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)] + cmd
    else:
        env["OMP_NUM_THREADS"] = "1"
    subprocess.run([sys.executable, *cmd], env=env, check=True, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="ngram")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve.md"))
    args = ap.parse_args()
    runs = {False: [], True: []}
    for _ in range(args.reps):
        for two in (False, True):
            runs[two].append(serve(two, args))
    same = all(r["outputs"] == runs[False][0]["outputs"] for rs in runs.values() for r in rs)
    lines = ["# python -m hal.launch: draft worker on another rank vs one process (SmolLM2-135M, greedy)\n",
             f"Command: `python benchmarks/serve.py --draft {args.draft} --k {args.k} --max-tokens {args.max_tokens} "
             f"--reps {args.reps}`; {time.strftime('%Y-%m-%d')}. Edit-code prompt of benchmarks/e2e.py; one thread "
             "per process in both setups. Outputs identical across all runs: " + ("yes" if same else "NO") + ".\n",
             "| setup | link | tokens | seconds (each rep) | median tok/s | overlap hits / misses (last rep) |",
             "|---|---|---:|---|---:|---|"]
    for two, label in ((False, "one process"), (True, "two ranks (torchrun)")):
        rs = runs[two]
        secs = [r["seconds"] for r in rs]
        lines.append(f"| {label} | {rs[-1]['link'] or '-'} | {rs[-1]['tokens']} | "
                     f"{', '.join(f'{s:.2f}' for s in secs)} | {rs[-1]['tokens'] / statistics.median(secs):.1f} | "
                     f"{rs[-1]['cache_hits']} / {rs[-1]['cache_misses']} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
