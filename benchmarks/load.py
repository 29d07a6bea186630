"""Load benchmark: an open-loop client against `spec-hal serve` (SmolLM2-135M on this CPU).

Poisson arrivals at each of ``--rates`` requests per second, a mixed prompt set (three
copy-heavy prompts and one open-ended, from benchmarks/e2e.py) and fixed output lengths
(``ignore_eos``), for each mode, interleaved rate by rate in one run:

* plain: a server with no drafter (``--draft none``; requests also say ``"speculative": {"k": 0}``);
* fixed: ``--draft`` drafts (n-gram unless told), k = ``--k`` every step (``--no-route``);
* routed: the router's k per request and step (``--route``, cap ``--k``; a block drafter's
  confidence cut after it);
* remote: routed, the drafter on a second torch.distributed rank (gloo on 127.0.0.1).

Reported per mode and rate: throughput (generated tokens / seconds from the first arrival
to the last token), TTFT / TPOT / end-to-end P50 and P99; a table and a PNG of P99 TPOT
against request rate, one line per mode.

    python benchmarks/load.py [--rates 1,2,4,8] [--requests 16] [--max-tokens 32] [--k 6] [--draft dspark]

``--case prefix``: chat requests sharing a system turn of about 650 tokens, each with its
own question, at ``--rates`` (default 1 req/s) against two servers, prefix caching on and
off (``--no-enable-prefix-caching``), interleaved request set by request set; TTFT P50/P99
and their ratio. Then ``n = 4`` against ``n = 1`` (sampled, non-streaming, one request at a
time, interleaved) on the caching server: wall time per request and its ratio.

    python benchmarks/load.py --case prefix [--rates 1] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from e2e import PROMPTS  # noqa: E402

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, k: int, port: int, extra: tuple[str, ...] = (), draft: str = "ngram") -> list[subprocess.Popen]:
    flags = ["--model", MODEL, "--draft", "none" if mode == "plain" else draft, "--k", str(k), "--port", str(port), "--max-num-seqs", "32",
             "--max-model-len", "512", "--cpu-budget-gib", "2", *extra]
    flags += ["--route"] if mode in ("routed", "remote") else ["--no-route"]
    log = open(Path("/tmp") / f"hal-load-{mode}.log", "w")
    if mode != "remote":
        return [subprocess.Popen([sys.executable, "-m", "hal", "serve", *flags], stdout=log, stderr=log)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    return [subprocess.Popen([sys.executable, "-m", "hal.server.app", *flags], env={**env, "RANK": str(r)},
                             stdout=log, stderr=log) for r in (1, 0)]


def wait_up(base: str, procs, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a server exited early; see /tmp/hal-load-*.log")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{base} did not come up within {timeout} s")


SYSTEM = " ".join(f"Rule {i}: answer in plain words, keep to the facts the user gave, and say which rule "
                  f"you followed." for i in range(1, 27))   # about 650 tokens with the chat template


async def one(client, base, prompt, n, k, t0, at, out, system=None, sampling: dict | None = None):
    """One streamed chat request sent at ``at`` s (greedy unless ``sampling`` says otherwise);
    its timings go to ``out``."""
    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    body = {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, **(sampling or {})}
    if k is not None:
        body["speculative"] = {"k": k}
    sent, stamps = time.perf_counter(), []
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                if ch["choices"] and ch["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    if stamps:
        out.append({"arrival": sent - t0, "ttft": stamps[0] - sent, "end": stamps[-1] - t0, "e2e": stamps[-1] - sent,
                    "tpot": (stamps[-1] - stamps[0]) / max(1, n - 1), "tokens": n})


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def run_load(base, rate, requests, n, k, seed, system=None):
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in range(requests):
        arrivals.append(t)
        t += rng.expovariate(rate)
    out: list[dict] = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(one(client, base, f"Question {i}: " + PROMPTS[i % len(PROMPTS)][2] if system
                                   else PROMPTS[i % len(PROMPTS)][2], n, k, t0, a, out, system)
                               for i, a in enumerate(arrivals)))
    return summary(out)


def summary(out: list[dict]) -> dict:
    """Throughput (tokens over the seconds from the first arrival to the last token) and the
    P50 / P99 of TTFT, TPOT and end to end, of one run's requests."""
    span = max(o["end"] for o in out) - min(o["arrival"] for o in out)
    return {"tok_s": sum(o["tokens"] for o in out) / span, "done": len(out),
            **{f"{m}{q}": pct([o[m] for o in out], q) for m in ("ttft", "tpot", "e2e") for q in (50, 99)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="1,2,4,8", help="requests per second (Poisson)")
    ap.add_argument("--requests", type=int, default=16, help="requests per rate and mode")
    ap.add_argument("--max-tokens", type=int, default=32, help="fixed output length (ignore_eos)")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--draft", default="ngram", help="the speculative modes' drafter (serve's --draft)")
    ap.add_argument("--modes", default="plain,fixed,routed,remote")
    ap.add_argument("--case", choices=["modes", "prefix"], default="modes")
    ap.add_argument("--out", help="default: benchmarks/results/load.md (load_prefix.md for --case prefix)")
    args = ap.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / ("load_prefix.md" if args.case == "prefix"
                                                                    else "load.md"))
    if args.case == "prefix":
        return prefix_case(args)
    rates = [float(r) for r in args.rates.split(",")]
    modes = args.modes.split(",")
    servers = {"fixed": "fixed", "plain": "plain", "routed": "routed", "remote": "remote"}
    procs, bases = [], {}
    try:
        for srv in dict.fromkeys(servers[m] for m in modes):
            port = free_port()
            ps = launch(srv, args.k, port, draft=args.draft)
            procs += ps
            bases[srv] = f"http://127.0.0.1:{port}"
            wait_up(bases[srv], ps)
        results = {}
        bar = tqdm(total=len(rates) * len(modes), desc="load", unit="run")
        for rate in rates:           # interleaved: every mode at one rate before the next rate
            for mode in modes:
                bar.set_postfix(rate=rate, mode=mode)
                results[(mode, rate)] = asyncio.run(run_load(bases[servers[mode]], rate, args.requests,
                                                             args.max_tokens, 0 if mode == "plain" else None,
                                                             seed=int(rate * 100)))
                bar.update()
        bar.close()
    finally:
        stop(procs)
    report(args, rates, modes, results)


def stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def machine_line() -> str:
    from hal.models.machine import machine_line as line
    return line()


async def n_choices(base, n, tokens, seed) -> float:
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "Tell me a story."}],
            "max_tokens": tokens, "temperature": 0.8, "seed": seed, "ignore_eos": True, "n": n}
    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        r = await client.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text[:300]
        return time.perf_counter() - t


def prefix_case(args) -> None:
    """TTFT with the prefix cache on and off, then n = 4 against n = 1 (see the module docstring)."""
    rates = [float(r) for r in (args.rates if args.rates != "1,2,4,8" else "1").split(",")]
    procs, bases = [], {}
    try:
        for mode, extra in (("cache on", ()), ("cache off", ("--no-enable-prefix-caching",))):
            # argparse keeps the last --max-model-len; prefill in chunks of 512 tokens per step
            extra = ("--max-model-len", "1024", "--max-num-batched-tokens", "512", *extra)
            port = free_port()
            ps = launch("fixed", args.k, port, extra)
            procs += ps
            bases[mode] = f"http://127.0.0.1:{port}"
            wait_up(bases[mode], ps)
        results = {}
        for rate in rates:
            for mode in bases:
                results[(mode, rate)] = asyncio.run(run_load(bases[mode], rate, args.requests, 16, None,
                                                             seed=int(rate * 100), system=SYSTEM))
        walls = {1: [], 4: []}
        for rep in range(5):
            for n in (1, 4):
                walls[n].append(asyncio.run(n_choices(bases["cache on"], n, args.max_tokens, seed=rep)))
    finally:
        stop(procs)
    cmd = "python benchmarks/load.py " + " ".join(sys.argv[1:])
    lines = ["# Prefix caching and n > 1 against `spec-hal serve` (SmolLM2-135M-Instruct, cpu, n-gram drafts)", "",
             f"Command: `{cmd.strip()}`; {args.requests} chat requests per rate and server, one system turn of "
             f"about 400 tokens and a different question each, 16 tokens each (greedy, ignore_eos), "
             f"--max-num-batched-tokens 512; {machine_line()}; {time.strftime('%Y-%m-%d')}.", "",
             "| rate (req/s) | TTFT P50 cache on / off (s) | TTFT P99 cache on / off (s) | P50 off / on |",
             "|---|---|---|---|"]
    for rate in rates:
        on, off = results[("cache on", rate)], results[("cache off", rate)]
        lines.append(f"| {rate:g} | {on['ttft50']:.3f} / {off['ttft50']:.3f} | {on['ttft99']:.3f} / "
                     f"{off['ttft99']:.3f} | {off['ttft50'] / on['ttft50']:.2f}x |")
    med = {n: sorted(w)[len(w) // 2] for n, w in walls.items()}
    lines += ["", f"n = 4 against n = 1 (the same system turn, {args.max_tokens} tokens per choice, temperature 0.8, "
              "5 requests each, interleaved, median wall time): "
              f"n = 1 {med[1]:.2f} s, n = 4 {med[4]:.2f} s: **{med[4] / med[1]:.2f}x**."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report(args, rates, modes, results) -> None:
    import torch
    cmd = "python benchmarks/load.py " + " ".join(a for a in sys.argv[1:])
    lines = [f"# Load: open-loop Poisson arrivals against `spec-hal serve` (SmolLM2-135M-Instruct, cpu, "
             f"{args.draft} drafts, k cap {args.k})", "",
             f"Command: `{cmd.strip()}`; {args.requests} chat requests per mode and rate, prompts cycling three "
             f"copy-heavy and one open-ended, {args.max_tokens} tokens each (ignore_eos), greedy; modes interleaved "
             f"rate by rate in one run; torch {torch.__version__}, {os.cpu_count()} cores, "
             f"{time.strftime('%Y-%m-%d')}.", "",
             "| rate (req/s) | mode | tok/s | vs plain | TTFT P50 / P99 (s) | TPOT P50 / P99 (ms) | E2E P50 / P99 (s) |",
             "|---|---|---|---|---|---|---|"]
    for rate in rates:
        plain = results.get(("plain", rate))
        for mode in modes:
            r = results[(mode, rate)]
            rel = f"{r['tok_s'] / plain['tok_s']:.2f}x" if plain else "-"
            lines.append(f"| {rate:g} | {mode} | {r['tok_s']:.1f} | {rel} | {r['ttft50']:.2f} / {r['ttft99']:.2f} | "
                         f"{r['tpot50'] * 1e3:.0f} / {r['tpot99'] * 1e3:.0f} | {r['e2e50']:.2f} / {r['e2e99']:.2f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for mode in modes:
        ax[0].plot(rates, [results[(mode, r)]["tpot99"] * 1e3 for r in rates], marker="o", label=mode)
        ax[1].plot(rates, [results[(mode, r)]["tok_s"] for r in rates], marker="o", label=mode)
    ax[0].set(xlabel="request rate (req/s)", ylabel="P99 TPOT (ms)", title="P99 TPOT against load")
    ax[1].set(xlabel="request rate (req/s)", ylabel="tokens/s", title="throughput against load")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
