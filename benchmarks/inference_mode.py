"""Engine steps in inference mode (what `hal.engine.SpeculativeDecoder.step` runs in) against
the same steps without it, side by side in one run (issue 37 item 2: per-op overhead).

Every ATen call made outside ``torch.inference_mode`` passes autograd's dispatch keys and
bumps version counters, even when nothing requires grad; a decode forward of SmolLM2-135M
is about 2,600 of them. Both variants run the same engine over the same model, alternating
request by request: the step as shipped, and its body without the mode
(``SpeculativeDecoder.step.__wrapped__``). Their tokens must be identical (the benchmark
stops otherwise); the ops and their bits are the same, only the dispatch differs.

    python benchmarks/inference_mode.py [--rounds 5] [--tokens 48] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from hal.drafters.kinds import make_drafter, parse_draft  # noqa: E402
from hal.engine import SamplingParams, SpeculativeDecoder  # noqa: E402
from hal.launch.build import build_engine  # noqa: E402
from hal.models.fetch import load_model  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402

PROMPT = list(range(300, 500))   # 200 prompt tokens, as the forward benchmarks' context


def run(dec: SpeculativeDecoder, batch: int, tokens: int, k: int, mode: bool) -> tuple[float, list]:
    """Decode ``batch`` requests of ``tokens`` greedy tokens each (prefill untimed); returns
    tokens/s over the decode steps and the outputs."""
    step = dec.step if mode else (lambda: SpeculativeDecoder.step.__wrapped__(dec))
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, k=k, stop_ids=())
    ids = [dec.add_request(PROMPT[:len(PROMPT) - i], params) for i in range(batch)]
    got = {rid: [] for rid in ids}
    while any(not got[r] for r in ids):    # prefill, and each request's first token
        for rid, toks in step().tokens.items():
            got[rid] += toks
    t0, made = time.perf_counter(), 0
    while dec.has_unfinished():
        for rid, toks in step().tokens.items():
            got[rid] += toks
            made += len(toks)
    return made / (time.perf_counter() - t0), [got[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/inference-mode.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    be = hal.get_backend("cpu")
    target, _ = load_model("smollm2-135m", be, "auto")
    cases = [("plain decode", build_engine(target, None), 1, 0),
             ("plain decode", build_engine(target, None), 4, 0),
             ("EAGLE head, k=4", build_engine(target, make_drafter(parse_draft("eagle"), be, target, "smollm2-135m")),
              1, 4)]
    lines = ["# Engine steps in inference mode against the same steps without it", "",
             f"Command: `python benchmarks/inference_mode.py --rounds {args.rounds} --tokens {args.tokens} "
             f"--threads {args.threads}`; {time.strftime('%Y-%m-%d')}; {machine_line(target.plan, args.threads)}.",
             f"Greedy, {len(PROMPT)}-token prompts, {args.tokens} tokens per request; tokens/s over the decode steps "
             f"(prefill untimed), medians of {args.rounds} rounds, the two variants alternating; tokens identical.", "",
             "| engine | requests | without ms/token | inference mode ms/token | ratio |", "|---|---:|---:|---:|---:|"]
    for name, dec, batch, k in cases:
        rates = {False: [], True: []}
        outs = {}
        run(dec, batch, 8, k, True)   # warm: the rope table, the scratch buffers
        for _ in range(args.rounds):
            for mode in (False, True):
                rate, out = run(dec, batch, args.tokens, k, mode)
                rates[mode].append(rate)
                if outs.setdefault(mode, out) != out or outs.get(not mode, out) != out:
                    raise SystemExit(f"{name}: the tokens differ with and without inference mode")
        off, on = (1e3 / statistics.median(rates[m]) for m in (False, True))
        lines.append(f"| {name} | {batch} | {off:.2f} | {on:.2f} | {on / off:.3f} |")
        print(lines[-1], flush=True)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
