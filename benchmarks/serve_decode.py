"""Plain decode through the HTTP server against the same engine in this process, and the thread
arrangement behind the difference, in one run (`hal.host_threads`).

1. ``spec-hal serve --draft none`` (a subprocess, as shipped): a 96-token greedy completion
   (``ignore_eos``), non-streamed and streamed, tokens/s over the request.
2. In this process, the same request through an engine built here (`build_engine`):
   - on the thread that loaded the model;
   - on a second thread, the loading thread still alive with its OpenMP team (how the server
     ran before stop 62: loaded on the main thread, decoded on the engine loop's);
   - on a second thread after the loading thread ended (how it runs now).
   The model is loaded again for each arrangement, in the thread it names; medians of
   ``--reps`` requests each.

    python benchmarks/serve_decode.py [--reps 5] [--tokens 96] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.load import free_port, wait_up  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from hal.engine import Request  # noqa: E402
from hal.host_threads import in_a_thread_that_ends  # noqa: E402
from hal.launch.build import build_engine  # noqa: E402
from hal.models.fetch import load_model  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402

PROMPT = "What are some fun things to do on a rainy weekend?"


def served(reps: int, tokens: int) -> tuple[float, float]:
    """Median tokens/s of ``spec-hal serve``: non-streamed, then streamed."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hal", "serve", "--draft", "none", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base, body = f"http://127.0.0.1:{port}", {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": tokens,
                                               "temperature": 0, "ignore_eos": True}
    try:
        wait_up(base, [proc])
        httpx.post(base + "/v1/completions", json={**body, "max_tokens": 8}, timeout=300)
        plain, stream = [], []
        for _ in range(reps):
            t = time.perf_counter()
            out = httpx.post(base + "/v1/completions", json=body, timeout=300).json()
            plain.append(out["usage"]["completion_tokens"] / (time.perf_counter() - t))
            t, n = time.perf_counter(), 0
            with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=300) as s:
                n = sum(1 for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]")
            stream.append(n / (time.perf_counter() - t))
        return statistics.median(plain), statistics.median(stream)
    finally:
        proc.terminate()
        proc.wait(60)


def decode_rate(dec, ids: list[int], tokens: int, reps: int) -> float:
    dec.generate([Request(ids, max_new_tokens=8, k=0)])
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        out = dec.generate([Request(ids, max_new_tokens=tokens, k=0)])[0]
        rates.append(len(out) / (time.perf_counter() - t))
    return statistics.median(rates)


def arrangement(where: str, tokens: int, reps: int) -> tuple[float, object]:
    """Tokens/s of the engine decoding as ``where`` says (see the module docstring)."""
    def load():
        model, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
        return build_engine(model, None), tok.encode(PROMPT).ids, model
    if where == "same":   # in a thread that ends too: this (main) thread never starts a team
        def both():
            dec, ids, model = load()
            return decode_rate(dec, ids, tokens, reps), model
        return in_a_thread_that_ends(both)
    if where == "ended":
        dec, ids, model = in_a_thread_that_ends(load)
        return in_a_thread_that_ends(lambda: decode_rate(dec, ids, tokens, reps), name="hal-engine"), model
    box: dict = {}   # "alive": the loader stays alive (with its team) while another thread decodes
    done, hold = threading.Event(), threading.Event()
    loader = threading.Thread(target=lambda: (box.update(got=load()), done.set(), hold.wait()), daemon=True)
    loader.start()
    done.wait()
    dec, ids, model = box["got"]
    rate = in_a_thread_that_ends(lambda: decode_rate(dec, ids, tokens, reps), name="hal-engine")
    hold.set()
    loader.join()   # its team ends with it, before the next arrangement
    return rate, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/serve-decode.md")
    args = ap.parse_args()
    plain, stream = served(args.reps, args.tokens)
    rates = {}
    for where in ("same", "alive", "ended"):
        rates[where], model = arrangement(where, args.tokens, args.reps)
    lines = ["# Plain decode through the server against the engine in-process, and the thread arrangement", "",
             f"Command: `python benchmarks/serve_decode.py --reps {args.reps} --tokens {args.tokens}`; "
             f"{time.strftime('%Y-%m-%d')}; {machine_line(model.plan, torch.get_num_threads())}. A {args.tokens}-token "
             f"greedy completion of one short prompt, tokens/s over the request, medians of {args.reps}.", "",
             "| decode | tokens/s | / in-process on the loading thread |", "|---|---:|---:|",
             f"| `spec-hal serve`, non-streamed | {plain:.1f} | {plain / rates['same']:.2f} |",
             f"| `spec-hal serve`, streamed | {stream:.1f} | {stream / rates['same']:.2f} |",
             f"| in-process, on the thread that loaded | {rates['same']:.1f} | 1.00 |",
             f"| in-process, another thread, the loader alive (the server before stop 62) | {rates['alive']:.1f} | "
             f"{rates['alive'] / rates['same']:.2f} |",
             f"| in-process, another thread, the loader ended (the server now) | {rates['ended']:.1f} | "
             f"{rates['ended'] / rates['same']:.2f} |"]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
