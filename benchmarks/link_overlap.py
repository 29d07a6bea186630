"""How much of the drafting and the link the two-rank protocol hides, at 0, 1 and 5 ms RTT.

The target rank in one network namespace, the draft worker in another, joined by
`tests.distributed.delayline` (a userspace wire: this kernel has no ``sch_netem``) with the one-way delay
that gives each round trip; the same launcher with the draft in the target's process is the
baseline, run right before each remote run (same threads: ``OMP_NUM_THREADS`` as here).

Per run: the target's step time (seconds / steps), its wait per round W (send, the worker's
drafting, receive), and the share of rounds whose drafting was hidden (the worker's overlap
guess held: it drafted them while the target verified).

    python benchmarks/link_overlap.py [--drafts eagle,ngram] [--rtts 0,1,5] [--k 3] [--max-tokens 64] [--no-route]
        [--fanouts 0,8] [--pushes off,on] [--prompts open|copy] [--pin --threads 1 --worker-threads 1]

``--pushes off,on``: each remote run without and with ``--push`` (the worker also sends the branches it
drafts ahead while the target verifies; a round whose every request was among them waits for no reply).
``--prompts copy``: two of `benchmarks/e2e.py`'s copy-heavy prompts instead of the open-ended ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import publish  # noqa: E402
from tests.distributed.delayline import tcp_rtt, wired  # noqa: E402

PROMPTS = ["What are some fun things to do on a rainy weekend?", "Explain glaciers to a beginner in a short paragraph."]


def prompts(args) -> list[str]:
    if args.prompts == "open":
        return PROMPTS
    from benchmarks.e2e import PROMPTS as E2E
    return [text for _, kind, text in E2E if kind == "copy"][:2]


def launcher(args, draft: str, out: Path, fanout: int | None = None, push: bool = False) -> list[str]:
    return [sys.executable, "-m", "hal.launch", "--draft", draft, "--k", str(args.k), "--max-tokens",
            str(args.max_tokens), "--out", str(out)] + ([] if args.route else ["--no-route"]) + \
        ([] if fanout is None else ["--fanout", str(fanout)]) + (["--push"] if push else []) + \
        [a for p in prompts(args) for a in ("--prompt", p)]


PINNED = " (target and baseline pinned to CPU 0, the worker to CPU 1)"


def pinned(args, cpu: int) -> list[str]:
    """``--pin``: the target and the in-process baseline on CPU 0, the draft worker on CPU 1."""
    return ["taskset", "-c", str(cpu)] if args.pin else []


def local(args, draft: str, out: Path) -> dict:
    r = subprocess.run(pinned(args, 0) + launcher(args, draft, out), capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(out.read_text())


def remote(args, draft: str, hosts, out: Path, fanout: int | None, push: bool = False) -> dict:
    t_ns, d_ns, t_ip, _, t_if, d_if = hosts
    env = {**os.environ, "MASTER_ADDR": t_ip, "MASTER_PORT": "29533", "WORLD_SIZE": "2",
           "HAL_PLACEMENT": "draft=cpu,target=cpu", "OMP_NUM_THREADS": str(args.threads)}
    cmd = launcher(args, draft, out, fanout, push)
    worker = subprocess.Popen(["ip", "netns", "exec", d_ns, *pinned(args, 1), *cmd],
                              env={**env, "RANK": "1", "GLOO_SOCKET_IFNAME": d_if,
                                   "OMP_NUM_THREADS": str(args.worker_threads)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        r = subprocess.run(["ip", "netns", "exec", t_ns, *pinned(args, 0), *cmd],
                           env={**env, "RANK": "0", "GLOO_SOCKET_IFNAME": t_if}, capture_output=True, text=True,
                           timeout=1200)
    finally:
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="eagle,ngram")
    ap.add_argument("--rtts", default="0,1,5", help="round trips to emulate, ms")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--route", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-route: a fixed k every round (the router otherwise sends k = 0 where drafts do not pay, "
                         "and then nothing is drafted ahead)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=__import__("torch").get_num_threads())
    ap.add_argument("--worker-threads", type=int, default=None, help="the draft rank's threads (default: --threads)")
    ap.add_argument("--fanouts", default="", help="the worker's --fanout values to run remote, e.g. 0,8 (default: "
                    "its default)")
    ap.add_argument("--pushes", default="off", help="remote runs without (off) and with (on) --push, e.g. off,on")
    ap.add_argument("--prompts", choices=("open", "copy"), default="open")
    ap.add_argument("--pin", action="store_true", help="the target and the in-process baseline on CPU 0, the worker "
                    "on CPU 1 (taskset): a second device of one core")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    args.worker_threads = args.worker_threads or args.threads
    from hal.models.machine import machine_line
    with wired("bo", 0.0) as h:
        base = tcp_rtt(h[0], h[1], h[3])   # the wire's own round trip at no delay
    fanouts = [int(f) for f in args.fanouts.split(",")] if args.fanouts else [None]
    variants = [(f, p == "on") for f in fanouts for p in args.pushes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rtt_ms in (float(x) for x in args.rtts.split(",")):
            one_way = max(0.0, (rtt_ms / 1e3 - base) / 2) * 1e3
            with wired("bo", one_way) as hosts:
                measured = tcp_rtt(hosts[0], hosts[1], hosts[3])
                for draft in args.drafts.split(","):
                    runs: dict = {v: [] for v in variants}
                    for rep in range(args.reps):
                        a = local(args, draft, Path(tmp) / f"l{rep}.json")
                        for v in variants:
                            runs[v].append((a, remote(args, draft, hosts, Path(tmp) / f"r{rep}.json", *v)))
                    for v, pairs in runs.items():
                        rows.append((rtt_ms, measured, draft, v, pairs))
                        print(rows[-1][:4], [(a["seconds"], b["seconds"]) for a, b in pairs], flush=True)
    lines = [f"# The link hidden or not: the draft on another namespace at 0, 1 and 5 ms RTT (SmolLM2-135M, greedy, "
             f"k={args.k})", "",
             f"Command: `python benchmarks/link_overlap.py --drafts {args.drafts} --rtts {args.rtts} --k {args.k} "
             f"--max-tokens {args.max_tokens} --reps {args.reps}{'' if args.route else ' --no-route'}"
             f"{f' --fanouts {args.fanouts}' if args.fanouts else ''}"
             f"{f' --pushes {args.pushes}' if args.pushes != 'off' else ''}"
             f"{f' --prompts {args.prompts}' if args.prompts != 'open' else ''}{' --pin' if args.pin else ''}"
             f"{f' --threads {args.threads} --worker-threads {args.worker_threads}' if args.pin else ''}`; "
             f"{time.strftime('%Y-%m-%d')}; {len(prompts(args))} {args.prompts} prompts "
             f"as one batch; the target and the baseline at {args.threads} threads, the worker at "
             f"{args.worker_threads}, on one host{PINNED if args.pin else ''} (network namespaces joined by "
             f"`tests.distributed.delayline`; its own round trip at no delay {base * 1e3:.3f} ms); {machine_line()}.",
             "", "| RTT asked / measured (ms) | draft | worker fan-out | push | step in-process (ms) | "
             "step remote (ms) | remote / in-process | tok/s remote / in-process | wait per round W (ms) | "
             "W - RTT (ms) | speculation cache hits / (hits + misses) | rounds pushed | branches per round | outputs |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    tps = lambda r: sum(len(o) for o in r["outputs"]) / r["seconds"]  # noqa: E731
    for rtt_ms, measured, draft, (fanout, push), pairs in rows:
        s_in = statistics.median(a["seconds"] / a["steps"] for a, _ in pairs)
        s_rem = statistics.median(b["seconds"] / b["steps"] for _, b in pairs)
        wait = statistics.median(b["round_trip_seconds"] / max(1, b["rounds"]) for _, b in pairs)
        speed = statistics.median(tps(b) / tps(a) for a, b in pairs)
        b = pairs[-1][1]
        same = all(a["outputs"] == b["outputs"] for a, b in pairs)
        lines.append(f"| {rtt_ms:g} / {measured * 1e3:.2f} | {draft} | {'default' if fanout is None else fanout} | "
                     f"{'on' if push else 'off'} | {s_in * 1e3:.1f} | {s_rem * 1e3:.1f} | {s_rem / s_in:.3f}x | "
                     f"{speed:.3f}x | "
                     f"{wait * 1e3:.2f} | {(wait - measured) * 1e3:.2f} | "
                     f"{100 * b['cache_hits'] / max(1, b['cache_hits'] + b['cache_misses']):.0f}% "
                     f"({b['cache_hits']} / {b['cache_hits'] + b['cache_misses']}) | "
                     f"{b.get('pushed_rounds', 0)} / {b['rounds']} | "
                     f"{b['fanout_branches'] / max(1, b['rounds']):.1f} | {'identical' if same else 'DIFFERENT'} |")
    lines += ["", "Step times are medians over the reps of seconds / steps; each remote run follows its in-process "
              "run. W is what the target waited per round (`round_trip_seconds / rounds`: send, the worker's "
              "drafting, receive). The worker's drafting is hidden for the requests answered from its speculation "
              "cache (`hal.distributed.speculate`: it drafted the likeliest outcomes while the target verified; an "
              "EAGLE head from its own features). Without push the link's round trip is "
              "never hidden: the target asks for the next drafts (the COMMIT is answered from the cache) only once "
              "it has verified; with push a round whose every request's outcome the worker had offered waits for "
              "no reply (rounds pushed). W - RTT is the rest of a round: the worker's drafting where not hidden, "
              "and on this "
              "2-core host both ranks and the wire sharing two cores (the target's OpenMP threads spin after each "
              "parallel region while the other processes wait for a core)."]
    publish(lines, Path(args.out) / "link-overlap.md")


if __name__ == "__main__":
    main()
