"""Run inside the target's network namespace (`tests/distributed/test_netns.py`): against the two-rank
server there, partition the link mid-stream (the target's end of the veth pair down), heal
it, and record what came back. Prints one JSON object. Every wait is bounded.

    ip netns exec NS python tests/distributed/netns_partition.py BASE_URL IFNAME MODEL"""

import json
import subprocess
import sys
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

BASE, IFNAME, MODEL = sys.argv[1:4]
PROMPTS = ["Repeat exactly: red green blue, red green blue, red green blue, red green blue.",
           "Count: one two three, one two three, one two three, one two three."]
LONG, SHORT = 160, 24


def counter(name: str) -> float:
    for fam in text_string_to_metric_families(httpx.get(BASE + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name in (name, name + "_total"):
                return s.value
    return 0.0


def until(what: str, cond, bound: float = 90.0) -> float:
    t = time.monotonic()
    while not cond():
        if time.monotonic() - t > bound:
            raise SystemExit(json.dumps({"error": f"not within {bound} s: {what}"}))
        time.sleep(0.05)
    return time.monotonic()


def complete(prompt: str, n: int, k: int | None = None) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    if k is not None:
        body["speculative"] = {"k": k}
    r = httpx.post(BASE + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def stream(prompt: str, n: int, into: dict) -> None:
    text, chunks = "", 0
    with httpx.stream("POST", BASE + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and (ch := json.loads(line[6:]))["choices"]:
                text += ch["choices"][0]["text"]
                chunks += 1
                into["chunks"] = chunks
    into.update(text=text, chunks=chunks, end=time.monotonic())


def link(state: str) -> None:
    subprocess.run(["ip", "link", "set", IFNAME, state], check=True, timeout=30)


def ready() -> bool:
    try:
        return httpx.get(BASE + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


until("the server ready", ready, 300)
want = {(p, n): complete(p, n, k=0) for p, n in ((PROMPTS[0], LONG), *((p, SHORT) for p in PROMPTS))}  # plain
got, long_out, stop = [], {}, threading.Event()


def traffic() -> None:   # requests one after another until told to stop
    i = 0
    while not stop.is_set() and i < 400:
        p = PROMPTS[i % 2]
        got.append((p, complete(p, SHORT)))
        i += 1


streamer = threading.Thread(target=stream, args=(PROMPTS[0], LONG, long_out))
loop = threading.Thread(target=traffic)
drafts0 = counter("spec_hal:spec_decode_num_drafts")
streamer.start()
loop.start()
until("drafts flowing", lambda: counter("spec_hal:spec_decode_num_drafts") > drafts0 + 3)
lost0 = counter("spec_hal:draft_workers_lost")   # a busy machine may have timed a round out already
t_down, at_down = time.monotonic(), long_out.get("chunks", 0)
link("down")
try:
    t_lost = until("the worker counted lost", lambda: counter("spec_hal:draft_workers_lost") > lost0)
finally:
    link("up")
t_up = time.monotonic()
t_back = until("the worker rejoined", lambda: counter("spec_hal:draft_workers_rejoined") >= counter(
    "spec_hal:draft_workers_lost"))
drafts_back = counter("spec_hal:spec_decode_num_drafts")
until("drafts resumed", lambda: counter("spec_hal:spec_decode_num_drafts") > drafts_back + 3)
stop.set()
loop.join(300)
streamer.join(300)
print(json.dumps({
    "lost_after_s": t_lost - t_down, "rejoin_s": t_back - t_up, "requests": len(got),
    "wrong": [i for i, (p, text) in enumerate(got) if text != want[(p, SHORT)]],
    "long_equal": long_out.get("text") == want[(PROMPTS[0], LONG)], "long_chunks": long_out.get("chunks"),
    "lost": counter("spec_hal:draft_workers_lost"), "rejoined": counter("spec_hal:draft_workers_rejoined"),
    "stream_chunks_at_down": at_down, "stream_ended_after_heal": long_out.get("end", 0) > t_up}))
