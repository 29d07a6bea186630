"""Do the defaults ever lose to plain decoding? ``spec-hal serve`` with its default flags
(the README's command) against ``--draft none``, both started here, traffic interleaved rate
by rate in one run:

* open: sampled open-ended chat (temperature 0.7, each request its own seed), Poisson arrivals
  at each of ``--rates``, ``--max-tokens`` each (ignore_eos, so both servers make the same work);
* copy: the three copy-heavy prompts of benchmarks/e2e.py, greedy, a closed loop of
  ``--copy-clients`` clients (each sends its next request when its last one ends): open-loop
  arrivals would measure the arrival rate (below capacity) or the batch's verify cost (far
  above it), not how fast a request is answered.

Each traffic and rate runs ``--rounds`` times, each round with its own arrival seed (the same
for both servers) and the servers' order swapped round by round (ABBA...), so a slow spell of a
shared machine lands on both. Reported per traffic, rate and server, over the rounds pooled:
throughput (generated tokens / the rounds' seconds from first arrival to last token), P50 / P99
TPOT and TTFT over every request; the default's ratio to ``none``, pooled and per round.

    python benchmarks/defaults.py [--rates 0.5,1,2] [--requests 16] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from e2e import PROMPTS  # noqa: E402
from load import MODEL, free_port, machine_line, one, stop, summary, wait_up  # noqa: E402

OPEN = ["What are some fun things to do on a rainy weekend?", "Explain why the sky is blue to a child.",
        "Write a short poem about autumn leaves.", "Give me three ideas for a birthday dinner.",
        "What should I pack for a week of hiking?", "Describe your ideal city in a few sentences.",
        "How do I start learning to play the guitar?", "Tell me a story about a lost umbrella."]
COPY = [p for _, kind, p in PROMPTS if kind == "copy"]
SERVERS = {"default": (), "none": ("--draft", "none")}


def launch(name: str, port: int) -> subprocess.Popen:
    log = open(Path("/tmp") / f"hal-defaults-{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "hal", "serve", "--model", MODEL, "--port", str(port),
                             "--max-num-seqs", "32", "--max-model-len", "1024", "--cpu-budget-gib", "2",
                             *SERVERS[name]], stdout=log, stderr=log)


async def run(base, prompts, rate, requests, n, temperature, seed, clients=None):
    """Poisson arrivals at ``rate``, or (``clients``) a closed loop of that many clients."""
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in range(requests):
        arrivals.append(0.0 if clients else t)
        t += 0.0 if clients else rng.expovariate(rate)
    out: list[dict] = []
    t0 = time.perf_counter()
    gate = asyncio.Semaphore(clients or requests)

    async def send(i, a):
        async with gate:
            await one(client, base, prompts[i % len(prompts)], n, None, t0, a, out,
                      sampling={"temperature": temperature, "seed": seed * 1000 + i})
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(send(i, a) for i, a in enumerate(arrivals)))
    return out


def pooled(rounds: list[list[dict]]) -> dict:
    """One server's rounds together: tokens over the summed spans, percentiles over every request."""
    spans = [max(o["end"] for o in r) - min(o["arrival"] for o in r) for r in rounds]
    every = summary([o for r in rounds for o in r])
    return {**every, "tok_s": sum(o["tokens"] for r in rounds for o in r) / sum(spans),
            "per_round": [summary(r)["tok_s"] for r in rounds]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="0.5,1,2", help="open-ended traffic, requests per second (Poisson)")
    ap.add_argument("--copy-clients", type=int, default=1, help="copy-heavy traffic: clients in a closed loop")
    ap.add_argument("--requests", type=int, default=16, help="requests per traffic, rate and server")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per traffic and rate, servers' order swapped each")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "defaults.md"))
    args = ap.parse_args()
    runs = [("open", float(r)) for r in args.rates.split(",")] + [("copy", 0.0)]
    procs, bases = [], {}
    try:
        for name in SERVERS:
            port = free_port()
            procs.append(launch(name, port))
            bases[name] = f"http://127.0.0.1:{port}"
            wait_up(bases[name], procs[-1:])
        results = measure(args, runs, bases)
    finally:
        stop(procs)
    report(args, runs, results)


def measure(args, runs, bases) -> dict:
    rounds: dict[tuple, list] = {}
    bar = tqdm(total=len(runs) * len(SERVERS) * args.rounds, desc="defaults", unit="run")
    for traffic, rate in runs:
        prompts, temperature = (OPEN, 0.7) if traffic == "open" else (COPY, 0.0)
        for j in range(args.rounds):
            order = list(SERVERS) if j % 2 == 0 else list(SERVERS)[::-1]
            for name in order:
                out = asyncio.run(run(bases[name], prompts, rate, args.requests, args.max_tokens, temperature,
                                      int(rate * 100) + 7919 * j, clients=args.copy_clients if traffic == "copy" else None))
                rounds.setdefault((traffic, rate, name), []).append(out)
                tqdm.write(f"{traffic} {rate:g} round {j} {name}: {summary(out)}")
                bar.update()
    bar.close()
    return {key: pooled(r) for key, r in rounds.items()}


def report(args, runs, results) -> None:
    cmd = "python benchmarks/defaults.py " + " ".join(sys.argv[1:])
    lines = ["# The defaults against plain decoding (`spec-hal serve` as the README starts it, and `--draft none`)",
             "", f"Command: `{cmd.strip()}`; {machine_line()}; {time.strftime('%Y-%m-%d')}. {args.requests} chat "
             f"requests per traffic, rate, server and round, {args.max_tokens} tokens each (ignore_eos); "
             f"{args.rounds} rounds, servers' order swapped each round; figures pooled over the rounds.", "",
             "| traffic | rate (req/s) or closed loop | server | tok/s | default / none (per round) | TPOT P50 / P99 (ms) | TTFT P50 / P99 (s) |",
             "|---|---|---|---|---|---|---|"]
    for traffic, rate in runs:
        none = results[(traffic, rate, "none")]
        for name in SERVERS:
            r = results[(traffic, rate, name)]
            per = ", ".join(f"{a / b:.2f}" for a, b in zip(r["per_round"], none["per_round"]))
            rel = f"{r['tok_s'] / none['tok_s']:.2f}x ({per})" if name == "default" else "-"
            lines.append(f"| {traffic} | {f'{rate:g}' if rate else f'{args.copy_clients} client(s)'} | {name} | {r['tok_s']:.1f} | {rel} | {r['tpot50'] * 1e3:.0f} / "
                         f"{r['tpot99'] * 1e3:.0f} | {r['ttft50']:.2f} / {r['ttft99']:.2f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
