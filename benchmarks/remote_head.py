"""The EAGLE head on the draft rank (torchrun, gloo on 127.0.0.1) against the same head in the
target's process: bytes per step over the link, the share of step time the target spends in
a round (send, the worker's drafting, receive), and the speed of both.

    python benchmarks/remote_head.py [--k 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hal.models.machine import machine_line

PROMPTS = ["What are some fun things to do on a rainy weekend?", "Explain glaciers to a beginner in a short paragraph."]


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, args, out: Path) -> dict:
    serve = ["-m", "hal.launch", "--draft", args.draft, "--k", str(args.k), "--max-tokens", str(args.max_tokens),
             "--out", str(out)] + [a for p in PROMPTS for a in ("--prompt", p)]
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                               "127.0.0.1", "--master-port", str(port())] if world == 2 else []) + serve
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-3000:])
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="eagle")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        local = run(1, args, Path(tmp) / "local.json")
        remote = run(2, args, Path(tmp) / "remote.json")
    same = local["outputs"] == remote["outputs"]
    steps = remote["steps"]
    lines = [f"# EAGLE head on the draft rank vs in-process (SmolLM2-135M, shipped head, greedy, k={args.k})", "",
             f"Command: `python benchmarks/remote_head.py --k {args.k} --max-tokens {args.max_tokens}`; "
             f"{time.strftime('%Y-%m-%d')}; two ranks under torchrun on one 2-core host (gloo over 127.0.0.1), "
             f"{len(PROMPTS)} prompts as one batch; {machine_line()}.", "",
             "| placement | tokens | seconds | tok/s | mean acc. length | steps |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in (("head in the target's process", local), ("head on the draft rank", remote)):
        lines.append(f"| {name} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens'] / r['seconds']:.1f} | "
                     f"{r['mean_acceptance_length']:.2f} | {r['steps']} |")
    lines += ["", f"Over the link: {remote['bytes_sent'] / steps / 1024:.1f} KiB per step target -> draft "
              f"(features: R x 576 float32 per accepted token, plus the committed ids), "
              f"{remote['bytes_received'] / steps / 1024:.2f} KiB per step back (draft ids); "
              f"{remote['rounds']} rounds; the target spent {remote['round_trip_seconds']:.2f} s of "
              f"{remote['seconds']:.2f} s in rounds ({100 * remote['round_trip_seconds'] / remote['seconds']:.0f}% "
              f"of step time). Outputs {'identical' if same else 'DIFFERENT'} across placements; draft failures "
              f"{remote['draft_failures']}."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote-head.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
