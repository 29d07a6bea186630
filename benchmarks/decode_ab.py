"""Plain decode of GGUF files by two checkouts of spec-hal and by llama.cpp, in one run.

For each file (``--files``) and each of ``--rounds`` rounds, interleaved: this checkout's
plain decode rate, the ``--before`` commit's (a git worktree of it, made in a temporary
folder and removed after), and ``llama-bench`` tg on the same file with the same threads
(``--no-llama`` leaves it out). spec-hal's rate is `benchmarks.llamacpp.our_decode_rate`:
``--tg`` tokens after a one-token prompt (``--prompt N``: after N tokens, timed after their
prefill; llama.cpp left out), k = 0, best of 3, each checkout in its own process
(its own kernel build, its own measured plan). Reported: the median rate of each over the
rounds, and the ratios. A file's plans are measured in each process, so the two checkouts
compete on equal terms; each process is timed after its load.

    python benchmarks/decode_ab.py --before <commit> --files a.gguf,b.gguf [--rounds 3] [--tg 64]
        [--threads 2] [--prompt 1] [--no-llama] [--out benchmarks/results/decode_ab.md]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llamacpp import llama_bench, llama_tools  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "decode_ab.md"
# run in a checkout's root (its ``hal`` first on the path): prints the plain decode rate, timed by
# this checkout's `our_decode_rate` (the same timing for both)
PROBE = """
import importlib.util, sys, torch
sys.path.insert(0, '.')
import hal
spec = importlib.util.spec_from_file_location('timing', {timing!r})
timing = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timing)
our_decode_rate = timing.our_decode_rate
from hal.models.loaders import load_gguf
torch.set_num_threads({threads})
model, _ = load_gguf({path!r}, hal.get_backend('cpu'), 'auto')
assert hal.__file__.startswith({root!r}), hal.__file__
print('RATE', our_decode_rate(model, {tg}, prompt={prompt}))
"""


def rate(root: Path, path: str, threads: int, tg: int, prompt: int = 1) -> float:
    """One checkout's plain decode rate (tokens/s) on ``path`` after ``prompt`` tokens, in a fresh process."""
    code = PROBE.format(threads=threads, path=path, root=str(root), tg=tg, prompt=prompt,
                        timing=str(ROOT / "benchmarks" / "llamacpp.py"))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RATE ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{root}: exited {out.returncode}: {out.stderr.strip()[-400:]}")
    return float(lines[-1].split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit to compare with (a git revision)")
    ap.add_argument("--files", required=True, help="comma-separated GGUF paths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1, help="decode after this many prompt tokens (the attention's "
                                                          "depth); above 1 needs --no-llama")
    ap.add_argument("--no-llama", action="store_true", help="leave llama-bench out")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.prompt < 1 or args.prompt > 1 and not args.no_llama:
        ap.error(f"--prompt: expected 1, or more with --no-llama (llama-bench's depth is not wired here), "
                 f"got {args.prompt}")
    bench = None if args.no_llama else llama_tools()[0]
    before = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    after = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hal-before-") as tmp:
        old = Path(tmp) / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for path in args.files.split(","):
                got = {"after": [], "before": [], "llama": []}
                for _ in range(args.rounds):
                    got["after"].append(rate(ROOT, path, args.threads, args.tg, args.prompt))
                    got["before"].append(rate(old, path, args.threads, args.tg, args.prompt))
                    if bench:
                        got["llama"].append(llama_bench(bench, Path(path), args.threads, args.tg))
                    print(path, {k: f"{v[-1]:.1f}" for k, v in got.items() if v}, flush=True)
                a, b = statistics.median(got["after"]), statistics.median(got["before"])
                ll = statistics.median(got["llama"]) if got["llama"] else None
                rows.append(f"| {Path(path).name} | {a:.1f} | {b:.1f} | {a / b:.2f}x | "
                            + (f"{ll:.1f} | {a / ll:.2f}x | {b / ll:.2f}x |" if ll else "- | - | - |"))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    publish(["# Plain decode: this checkout, an earlier one and llama.cpp on the same files", "",
             f"`python benchmarks/decode_ab.py --before {args.before} --files {args.files} --rounds {args.rounds} "
             f"--tg {args.tg} --threads {args.threads} --prompt {args.prompt}" + " --no-llama" * args.no_llama + "`",
             "", machine_line(), "",
             f"after: {after}; before: {before}. Decode: {args.tg} tokens after a "
             + ("one-token prompt" if args.prompt == 1 else f"{args.prompt}-token prompt (timed after its prefill)")
             + ", k = 0, "
             f"{args.threads} threads; spec-hal best of 3 per process"
             + ("" if args.no_llama else ", llama-bench tg mean of 3") + "; the median over "
             f"{args.rounds} interleaved rounds.", "",
             "| file | after tok/s | before tok/s | after / before | llama.cpp tok/s | after / llama.cpp | "
             "before / llama.cpp |", "|---|---|---|---|---|---|---|", *rows], Path(args.out))


if __name__ == "__main__":
    main()
