"""How long one long prompt freezes the streams already running (issue 66, item 4): chunked prefill.

For each token budget (``--budgets``; ``--max-num-batched-tokens`` of `spec-hal serve`), one
server (SmolLM2-135M, the default drafter and routing, ``--max-model-len`` 2048): ``--streams``
greedy streams of ``--max-tokens`` tokens each (``ignore_eos``) start; once every one has its
first tokens, one prompt of ``max-model-len - 64`` tokens arrives. Reported per budget:

* the worst inter-token gap any stream saw (client side, SSE chunk to chunk) while the long
  prompt was prefilled, and the median gap before it arrived;
* the long prompt's time to first token;
* the streams' throughput over the whole run.

A budget of 2048 (the context) is what the server did before chunked prefill was on by default:
the long prompt went in one step.

    python benchmarks/prefill_stall.py [--budgets 2048,512,256] [--streams 16] [--max-tokens 160]
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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load import MODEL, free_port, stop, wait_up  # noqa: E402
from report import publish  # noqa: E402

from hal.models.machine import machine_line  # noqa: E402

OUT = Path(__file__).parent / "results" / "prefill_stall.md"
CONTEXT = 2048


def launch(budget: int | None, port: int) -> subprocess.Popen:
    flags = ["--model", MODEL, "--port", str(port), "--max-model-len", str(CONTEXT), "--cpu-budget-gib", "3"]
    if budget is not None:
        flags += ["--max-num-batched-tokens", str(budget)]
    log = open(f"/tmp/hal-prefill-stall-{budget}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "hal", "serve", *flags], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HAL_BACKEND": "cpu"})


async def stream(c: httpx.AsyncClient, i: int, max_tokens: int, times: list[float], started: asyncio.Event):
    body = {"model": MODEL, "prompt": f"Write a long story about the number {i}.", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(time.perf_counter())
                    if len(times) >= 4:
                        started.set()


async def one_budget(base: str, streams: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    long_prompt = [rng.randrange(200, 40000) for _ in range(CONTEXT - 64)]
    async with httpx.AsyncClient(base_url=base, timeout=600) as c:
        times = [[] for _ in range(streams)]
        flags = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.create_task(stream(c, i, max_tokens, times[i], flags[i])) for i in range(streams)]
        await asyncio.gather(*(f.wait() for f in flags))
        sent = time.perf_counter()
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1,
                                                   "temperature": 0})
        first = time.perf_counter()
        r.raise_for_status()
        await asyncio.gather(*tasks)
    before = [b - a for t in times for a, b in zip(t, t[1:]) if b < sent]
    during = [b - a for t in times for a, b in zip(t, t[1:]) if b > sent and a < first]
    tokens = sum(len(t) for t in times)
    span = max(t[-1] for t in times) - min(t[0] for t in times)
    return {"worst": max(during, default=0.0), "median_before": statistics.median(before), "ttft": first - sent,
            "throughput": tokens / span}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="2048,512,256", help="comma-separated token budgets; 'default': the flag unset")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    for b in args.budgets.split(","):
        budget = None if b == "default" else int(b)
        port = free_port()
        proc = launch(budget, port)
        try:
            wait_up(f"http://127.0.0.1:{port}", [proc], timeout=600)
            got = asyncio.run(one_budget(f"http://127.0.0.1:{port}", args.streams, args.max_tokens, args.seed))
        finally:
            stop([proc])
        if budget is None:   # what the server chose, as its start-up line says
            log = Path(f"/tmp/hal-prefill-stall-{budget}.log").read_text()
            said = next((ln for ln in log.splitlines() if "chunked prefill: " in ln), "chunked prefill: ? tokens")
            b = f"unset ({said.split('chunked prefill: ')[1].split(' tokens')[0]})"
        rows.append(f"| {b} | {got['worst'] * 1000:.0f} | {got['median_before'] * 1000:.0f} | {got['ttft']:.2f} | "
                    f"{got['throughput']:.1f} |")
        print(rows[-1], flush=True)
    lines = ["# One long prompt among running streams: the worst inter-token gap, by token budget", "",
             f"`python benchmarks/prefill_stall.py --budgets {args.budgets} --streams {args.streams} "
             f"--max-tokens {args.max_tokens}`", "", machine_line(), "",
             f"SmolLM2-135M, the server's default drafter and routing, {args.streams} greedy streams of "
             f"{args.max_tokens} tokens, then one prompt of {CONTEXT - 64} tokens (max-model-len {CONTEXT} - 64). "
             "Gaps are client-side, SSE chunk to chunk; 2048 = the whole prompt in one step (the old default, "
             "unbounded, did the same).", "",
             "| --max-num-batched-tokens | worst gap while it prefills (ms) | median gap before (ms) | "
             "long prompt TTFT (s) | streams' tok/s |", "|---|---|---|---|---|", *rows]
    publish(lines, OUT)


if __name__ == "__main__":
    main()
