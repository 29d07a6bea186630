"""A bounded soak of `spec-hal serve` with its drafter on a second rank (not in `make test`).

``--minutes`` (default 20) of Poisson traffic at ``--rate`` requests/s against a target rank
whose n-gram drafter runs on a draft rank (torch.distributed, gloo on 127.0.0.1): chat and
completions, streaming or not, some with ``n = 2``, some under a JSON schema, some sharing a
system turn (the prefix cache), and a share of clients that disconnect mid-answer. At
``--kill-at`` of the run the draft rank is killed (SIGKILL); the target serves on alone, and
``--rejoin-after`` seconds later a fresh draft rank starts and rejoins by the next epoch
(`hal.distributed.rendezvous`).

Checked at the end, after the traffic has drained:

* KV blocks in use back to zero in every pool the target reports;
* the target's RSS and thread count flat: at most ``--rss-slack`` (default 1.25x + 64 MiB)
  and the same thread count (+2) as after the first minute;
* no error other than the counted ones: client disconnects we made and 503 busy;
  every other answer is 200, its choices complete (a finish_reason each), JSON answers parse;
* the fresh draft rank rejoined (``spec_hal:draft_workers_rejoined``).

    python benchmarks/soak.py [--minutes 20] [--rate 2] [--kill-at 0.5] [--rejoin-after 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from load import MODEL, free_port, stop, wait_up  # noqa: E402
from report import publish  # noqa: E402

from hal.models.machine import machine_line  # noqa: E402

OUT = Path(__file__).parent / "results" / "soak.md"
SYSTEM = "You are a patient assistant. Answer in two short sentences and never use lists. " * 6
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "string", "maxLength": 20}, "sure": {"type": "boolean"}}}
QUESTIONS = ["Why is the sky blue?", "Name three rivers.", "What is 17 times 3?", "Write a haiku about rain.",
             "Repeat: a b c a b c a b c", "Explain a hash table.", "What is the capital of Peru?"]


def launch(port: int, world: int = 2, log_path: str = "/tmp/hal-soak.log"):
    """{rank: process}, and a function that starts a fresh draft rank (it joins the next epoch).
    ``world`` 1: the target alone, its drafter in its own process (no draft rank)."""
    import subprocess
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "HAL_BACKEND": "cpu"}
    flags = ["--model", MODEL, "--draft", "ngram", "--k", "4", "--port", str(port), "--max-num-seqs", "16",
             "--max-model-len", "1024", "--max-num-batched-tokens", "512", "--cpu-budget-gib", "3",
             "--draft-timeout", "5"]
    log = open(log_path, "w")

    def rank(r: int):
        return subprocess.Popen([sys.executable, "-m", "hal.server.app", *flags], env={**env, "RANK": str(r)},
                                stdout=log, stderr=log)
    return {r: rank(r) for r in ((1, 0) if world == 2 else (0,))}, lambda: rank(1)


def proc_stats(pid: int) -> tuple[int, int]:
    """(RSS bytes, threads) of ``pid``."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"])


def metrics(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def body(rng: random.Random, i: int) -> tuple[str, dict, bool]:
    """(path, body, whether this client disconnects mid-answer)."""
    q = rng.choice(QUESTIONS)
    chat = rng.random() < 0.7
    b = {"model": MODEL, "max_tokens": rng.choice([8, 16, 32, 48]), "temperature": rng.choice([0, 0.7]),
         "seed": i, "stream": rng.random() < 0.5}
    if b["stream"]:   # the last chunk then counts the tokens (`soak_tpot.py`'s TPOT)
        b["stream_options"] = {"include_usage": True}
    if rng.random() < 0.15:
        b["n"] = 2
    if chat:
        msgs = ([{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []) + [{"role": "user",
                                                                                           "content": q}]
        b["messages"] = msgs
        if rng.random() < 0.15:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
            b["max_tokens"] = 64
    else:
        b["prompt"] = q
    return ("/v1/chat/completions" if chat else "/v1/completions"), b, rng.random() < 0.2


async def one(client, base, path, b, leave, counts: Counter, rng: random.Random, tpots: list | None = None) -> None:
    """One request; ``tpots``: where a streamed single-choice answer of two or more tokens adds
    its seconds per output token after the first (first to last chunk with text, over the
    tokens its usage counts, less one)."""
    try:
        if b["stream"]:
            async with client.stream("POST", base + path, json=b) as r:
                if r.status_code != 200:
                    counts[f"http {r.status_code}"] += 1
                    return
                finished, n, times, tokens = set(), 0, [], 0
                async for line in r.aiter_lines():
                    if leave and n >= 2:
                        counts["disconnected (ours)"] += 1
                        return
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])
                        if "error" in ch:
                            counts["stream error"] += 1
                            return
                        n += 1
                        if any((c.get("delta") or {}).get("content") or c.get("text") for c in ch["choices"]):
                            times.append(time.monotonic())   # a chunk with text (not the role chunk)
                        tokens = (ch.get("usage") or {}).get("completion_tokens", tokens)
                        finished |= {c["index"] for c in ch["choices"] if c.get("finish_reason")}
                ok = len(finished) == b.get("n", 1)
                counts["ok" if ok else "stream incomplete"] += 1
                if tpots is not None and ok and b.get("n", 1) == 1 and tokens >= 2 and len(times) >= 2:
                    tpots.append((times[-1] - times[0]) / (tokens - 1))
        else:
            timeout = 0.3 + rng.random() if leave else 600
            try:
                r = await client.post(base + path, json=b, timeout=timeout)
            except httpx.TimeoutException:
                counts["disconnected (ours)"] += 1
                return
            if r.status_code != 200:
                counts[f"http {r.status_code}"] += 1
                return
            choices = r.json()["choices"]
            ok = len(choices) == b.get("n", 1) and all(c["finish_reason"] for c in choices)
            if ok and "response_format" in b:
                for c in choices:
                    if c["finish_reason"] == "stop":
                        json.loads(c["message"]["content"])
            counts["ok" if ok else "incomplete"] += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        counts[f"client error {type(e).__name__}"] += 1


async def traffic(base, minutes, rate, seed, procs, kill_at, samples, restart=None, rejoin_after=30.0,
                  tpots: list | None = None) -> Counter:
    """Poisson traffic; at ``kill_at`` the draft rank dies (never at ``kill_at`` > 1), and
    ``rejoin_after`` s later ``restart()`` (if given) starts a fresh one, which rejoins by the
    next epoch. ``tpots``: see `one`."""
    rng, counts, tasks = random.Random(seed), Counter(), []
    t0, end, killed, i, next_sample = time.monotonic(), time.monotonic() + 60 * minutes, False, 0, 0.0
    restarted = restart is None
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        while time.monotonic() < end:
            now = time.monotonic() - t0
            if not killed and kill_at <= 1 and now >= kill_at * 60 * minutes:
                procs[1].send_signal(signal.SIGKILL)
                killed = True
                samples.append(("worker killed", now, *proc_stats(procs[0].pid)))
            if killed and not restarted and now >= kill_at * 60 * minutes + rejoin_after:
                procs[1] = restart()
                restarted = True
                samples.append(("fresh worker started", now, *proc_stats(procs[0].pid)))
            if now >= next_sample:
                samples.append(("sample", now, *proc_stats(procs[0].pid)))
                next_sample += 60
            path, b, leave = body(rng, i)
            tasks.append(asyncio.ensure_future(one(client, base, path, b, leave, counts, rng, tpots)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the run at which the draft rank dies")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rejoin-after", type=float, default=30.0,
                    help="seconds after the kill a fresh draft rank starts (it rejoins); negative: never")
    ap.add_argument("--rss-slack", type=float, default=1.25)
    args = ap.parse_args()
    port = free_port()
    procs, restart = launch(port)
    base = f"http://127.0.0.1:{port}"
    samples: list[tuple] = []
    try:
        wait_up(base, list(procs.values()))
        counts = asyncio.run(traffic(base, args.minutes, args.rate, args.seed, procs, args.kill_at, samples,
                                     restart if args.rejoin_after >= 0 else None, args.rejoin_after))
        deadline = time.monotonic() + 120   # the engine drains what the clients left
        while time.monotonic() < deadline:
            m = metrics(base)
            used = {dict(k[1]).get("pool"): v for k, v in m.items() if k[0] == "spec_hal:kv_blocks_used"}
            if m.get(("spec_hal:num_requests_running", ()), 1) == 0 and all(v == 0 for v in used.values()):
                break
            time.sleep(1)
        rss, threads = proc_stats(procs[0].pid)
        samples.append(("end", time.monotonic(), rss, threads))
    finally:
        stop(list(procs.values()))
    first = next((s for s in samples if s[0] == "sample" and s[1] >= 60), samples[0])
    flat_rss = rss <= first[2] * args.rss_slack + (64 << 20)
    flat_threads = threads <= first[3] + 2
    allowed = {"ok", "disconnected (ours)", "http 503"}
    bad = {k: v for k, v in counts.items() if k not in allowed}
    rejoined = m.get(("spec_hal:draft_workers_rejoined_total", ()), 0)
    resumed = rejoined >= 1 or args.rejoin_after < 0
    passed = flat_rss and flat_threads and not bad and all(v == 0 for v in used.values()) and resumed
    lines = ["# Soak: `spec-hal serve`, n-gram drafter on a second rank, one worker kill and a fresh one", "",
             f"Command: `python benchmarks/soak.py --minutes {args.minutes:g} --rate {args.rate:g} --kill-at "
             f"{args.kill_at:g} --rejoin-after {args.rejoin_after:g} --seed {args.seed}`; {time.strftime('%Y-%m-%d')}; "
             f"{machine_line()}.", "",
             f"**{'PASS' if passed else 'FAIL'}**: KV blocks in use at the end {used}; RSS "
             f"{first[2] / 2**20:.0f} MiB after the first minute, {rss / 2**20:.0f} MiB at the end "
             f"({'flat' if flat_rss else 'GREW'}); threads {first[3]} then {threads} "
             f"({'flat' if flat_threads else 'GREW'}); answers {dict(counts)}"
             + (f"; unexpected: {bad}" if bad else "") + ".", "",
             "| event | t (s) | RSS (MiB) | threads |", "|---|---|---|---|"]
    lines += [f"| {name} | {'-' if name == 'end' else f'{t:.0f}'} | {r / 2**20:.0f} | {th} |"
              for name, t, r, th in samples]
    m_fail = m.get(("spec_hal:draft_failures_total", ()), 0)
    lost = m.get(("spec_hal:draft_workers_lost_total", ()), 0)
    lines += ["", f"Draft failures counted by the target: {m_fail:g} (the kill); workers lost {lost:g}, rejoined "
              f"{rejoined:g} (the fresh worker, by the next epoch)" + ("" if resumed else ": NOT REJOINED") + "."]
    publish(lines, OUT)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
