"""Long use of `spec-hal serve` (issue 66): mixed traffic for ``--minutes`` (default 10), one process.

The server runs with its defaults (n-gram drafts, routed; chunked prefill at the default budget)
and ``--max-model-len 4096``. Poisson arrivals at ``--rate`` requests/s, each one of:

* answers of 1 to 2,048 tokens (``ignore_eos`` for the long ones, so they are that long), after
  prompts of a few tokens up to about 1,500;
* greedy and sampled; chat and completions; streamed and not; some with ``n = 2``;
* some under a JSON schema (structured output);
* some whose client disconnects mid-answer (counted, not errors).

Each request has ``--deadline`` seconds to finish; one that has not is a **hang**. Reported: the
answers by outcome, errors (any non-200 other than 503 busy, any incomplete answer, any error
event), hangs, the P50/P99 TPOT of streamed answers, and at the end: /health, KV blocks in
use and requests in flight (all must be back to ok / 0 / 0). Exit 1 on any error or hang.

    python benchmarks/soak_long.py [--minutes 10] [--rate 0.3] [--deadline 900] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load import MODEL, free_port, stop, wait_up  # noqa: E402
from report import publish  # noqa: E402
from soak import SCHEMA, metrics, proc_stats  # noqa: E402

from hal.models.machine import machine_line  # noqa: E402

OUT = Path(__file__).parent / "results" / "soak_long.md"
LENGTHS, WEIGHTS = [1, 8, 32, 128, 512, 2048], [2, 3, 3, 2, 1, 0.5]
WORDS = ("river stone lamp orbit cedar quartz lantern meadow signal harbor copper violet thunder "
         "marble falcon ember tide glacier pepper canyon").split()


def body(rng: random.Random, i: int) -> tuple[str, dict, bool]:
    """(path, body, whether this client disconnects mid-answer)."""
    n_tokens = rng.choices(LENGTHS, WEIGHTS)[0]
    words = rng.choice([3, 20, 200, 1000])
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    b = {"model": MODEL, "max_tokens": n_tokens, "temperature": rng.choice([0, 0, 0.8]), "seed": i,
         "stream": rng.random() < 0.6, "ignore_eos": n_tokens >= 128}
    if b["stream"]:
        b["stream_options"] = {"include_usage": True}
    if rng.random() < 0.1:
        b["n"] = 2
    chat = rng.random() < 0.6
    if chat:
        b["messages"] = [{"role": "user", "content": f"Summarize: {text}"}]
        if rng.random() < 0.12:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
            b["max_tokens"], b["ignore_eos"] = 64, False
    else:
        b["prompt"] = f"{text}\nContinue the list:"
    return ("/v1/chat/completions" if chat else "/v1/completions"), b, rng.random() < 0.1


async def one(client, base, path, b, leave, deadline: float, counts: Counter, tpots: list) -> None:
    try:
        await asyncio.wait_for(_one(client, base, path, b, leave, counts, tpots), deadline)
    except asyncio.TimeoutError:
        counts["HANG"] += 1


async def _one(client, base, path, b, leave, counts: Counter, tpots: list) -> None:
    try:
        if not b["stream"]:
            r = await client.post(base + path, json=b, timeout=None)
            if r.status_code != 200:
                counts["http 503 (busy)" if r.status_code == 503 else f"ERROR http {r.status_code}"] += 1
                return
            choices = r.json()["choices"]
            ok = len(choices) == b.get("n", 1) and all(c["finish_reason"] in ("stop", "length") for c in choices)
            if ok and "response_format" in b:
                for c in choices:
                    if c["finish_reason"] == "stop":
                        json.loads(c["message"]["content"])
            counts["ok" if ok else "ERROR incomplete"] += 1
            return
        async with client.stream("POST", base + path, json=b, timeout=None) as r:
            if r.status_code != 200:
                counts["http 503 (busy)" if r.status_code == 503 else f"ERROR http {r.status_code}"] += 1
                return
            finished, chunks, times, tokens = set(), 0, [], 0
            async for line in r.aiter_lines():
                if leave and chunks >= 3:
                    counts["disconnected (ours)"] += 1
                    return
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])
                    if "error" in ch:
                        counts["ERROR stream error event"] += 1
                        return
                    chunks += 1
                    if any((c.get("delta") or {}).get("content") or c.get("text") for c in ch["choices"]):
                        times.append(time.monotonic())
                    tokens = (ch.get("usage") or {}).get("completion_tokens", tokens)
                    finished |= {c["index"] for c in ch["choices"] if c.get("finish_reason")}
            ok = len(finished) == b.get("n", 1)
            counts["ok" if ok else "ERROR stream incomplete"] += 1
            if ok and b.get("n", 1) == 1 and tokens >= 2 and len(times) >= 2:
                tpots.append((times[-1] - times[0]) / (tokens - 1))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        counts[f"ERROR client {type(e).__name__}"] += 1


async def traffic(base, minutes, rate, seed, deadline) -> tuple[Counter, list, Counter]:
    rng, counts, tpots, sent, tasks = random.Random(seed), Counter(), [], Counter(), []
    end = time.monotonic() + 60 * minutes
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1024)) as client:
        i = 0
        while time.monotonic() < end:
            path, b, leave = body(rng, i)
            sent[f"{b['max_tokens']} tokens"] += 1
            tasks.append(asyncio.ensure_future(one(client, base, path, b, leave, deadline, counts, tpots)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return counts, tpots, sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=0.3)
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds a request may take before it is a hang")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open("/tmp/hal-soak-long.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "hal", "serve", "--model", MODEL, "--port", str(port),
                             "--max-model-len", "4096", "--cpu-budget-gib", "4"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HAL_BACKEND": "cpu"})
    try:
        wait_up(base, [proc], timeout=600)
        t0 = time.monotonic()
        counts, tpots, sent = asyncio.run(traffic(base, args.minutes, args.rate, args.seed, args.deadline))
        wall = time.monotonic() - t0
        health = httpx.get(base + "/health", timeout=30).json()
        m = metrics(base)
        used = {dict(k[1]).get("pool"): v for k, v in m.items() if k[0] == "spec_hal:kv_blocks_used"}
        in_flight = m.get(("spec_hal:num_requests_in_flight", ()), -1)
        rss, threads = proc_stats(proc.pid)
        alive = proc.poll() is None
    finally:
        stop([proc])
    errors = sum(v for k, v in counts.items() if k.startswith("ERROR"))
    hangs = counts.get("HANG", 0)
    clean = health.get("status") == "ok" and all(v == 0 for v in used.values()) and in_flight == 0 and alive
    passed = errors == 0 and hangs == 0 and clean
    q = statistics.quantiles(tpots, n=100) if len(tpots) >= 2 else [float("nan")] * 99
    lines = ["# Long use: `spec-hal serve` under mixed traffic (answers of 1 to 2,048 tokens)", "",
             f"Command: `python benchmarks/soak_long.py --minutes {args.minutes:g} --rate {args.rate:g} --deadline "
             f"{args.deadline:g} --seed {args.seed}`; {time.strftime('%Y-%m-%d')}; {machine_line()}.", "",
             f"**{'PASS' if passed else 'FAIL'}**: {errors} errors, {hangs} hangs (a request unfinished after "
             f"{args.deadline:g} s); {sum(counts.values())} requests over {wall / 60:.1f} min (traffic and drain).", "",
             f"- answers: {dict(sorted(counts.items()))}",
             f"- asked lengths: {dict(sorted(sent.items(), key=lambda kv: int(kv[0].split()[0])))}",
             f"- TPOT of streamed single-choice answers ({len(tpots)}): P50 {q[49] * 1000:.1f} ms, "
             f"P99 {q[98] * 1000:.1f} ms",
             f"- at the end: /health {health}, KV blocks in use {used}, requests in flight {in_flight:g}, "
             f"RSS {rss / 2**20:.0f} MiB, {threads} threads, the server {'running' if alive else 'EXITED'}"]
    publish(lines, OUT)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
