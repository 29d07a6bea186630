"""Held-out tau of block drafters against the EAGLE head's chain of 4 (issue 35's first target),
in one run: greedy decoding of prompts on topics never trained on
(`hal.training.data.HELDOUT_TOPICS`), every proposal verified (no router), scored as the engine's
tokens per verify step (mean accepted length + 1) and acceptance by position. Greedy drafts and
verification are deterministic, so the counts do not depend on the machine's load.

    python benchmarks/dspark_heldout.py [--prompts 24] [--max-new-tokens 64] [--float-too] [BLOCK_FOLDER ...]
    (default: the shipped block drafter)

``--float-too``: under a q4q8 plan the drafters' linear weights run as Q8 tiles
(`hal.models.llama.Llama.draft_weight`); this also scores every drafter with float weights in
the plan's dtype, side by side, so the rows say what the quantized weights cost in acceptance.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hal
from draft_linears import float_weights
from hal.drafters.kinds import make_drafter, parse_draft
from hal.engine.requests import Request
from hal.launch.build import build_engine
from hal.models.fetch import load_model
from hal.models.machine import machine_line
from hal.models.tokenizer import chatml
from hal.training import data


def score(dec, ids: list[list[int]], k: int, max_new_tokens: int, stop) -> dict:
    dec.generate([Request(p, max_new_tokens=max_new_tokens, k=k, stop_ids=stop) for p in ids])
    m = dec.metrics.total
    return {"tau": m.mean_acceptance_length, "by_position": [round(a, 3) for a in m.acceptance_by_position()[:k]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/dspark-heldout.md")
    ap.add_argument("--float-too", action="store_true", help="also score each drafter with float weights")
    ap.add_argument("blocks", nargs="*", help="block drafter folders (default: the shipped one)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    ids = [tok.encode(chatml(p)).ids for p in data.prompts(heldout=True)[:args.prompts]]
    stop, be = target.cfg.stop_ids, target.be
    rows = []
    for form in ("plan", "float") if args.float_too else ("plan",):
        build = (lambda make: float_weights(target, make)) if form == "float" else (lambda make: make())
        tag = ", float weights" if form == "float" else ""
        eagle = build(lambda: make_drafter(parse_draft("eagle"), be, target, "smollm2-135m"))
        rows.append((f"EAGLE head, chain of 4{tag}", score(build_engine(target, eagle, k=4), ids, 4,
                                                           args.max_new_tokens, stop)))
        for folder in args.blocks or [None]:
            kind = parse_draft(f"dspark:{folder}" if folder else "dspark")
            drafter = build(lambda: make_drafter(kind, be, target, "smollm2-135m"))
            k = drafter.model.proposals
            rows.append((f"block drafter {folder or '(shipped)'}, fixed block k={k}{tag}",
                         score(build_engine(target, drafter, k=k), ids, k, args.max_new_tokens, stop)))
    base = rows[0][1]["tau"]
    lines = ["# Held-out tau: block drafters against the EAGLE head's chain of 4", "",
             f"`python benchmarks/dspark_heldout.py --prompts {args.prompts} --max-new-tokens {args.max_new_tokens}"
             + " --float-too" * args.float_too + "".join(f" {b}" for b in args.blocks) + f"`; {machine_line(target.plan)}; {time.strftime('%Y-%m-%d')}; "
             f"greedy, {len(ids)} held-out-topic prompts, every proposal verified.", "",
             "| drafter | tau (tokens / verify step) | vs EAGLE chain | acceptance by position |",
             "|---|---:|---:|---|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['tau']:.2f} | {r['tau'] / base:.2f}x | {r['by_position']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
