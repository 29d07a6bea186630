"""The DSpark block drafter against plain decoding and the EAGLE head, on open-ended prompts
nobody tuned for (`benchmarks/defaults.py`'s OPEN, none of them trained on) and on the
copy-heavy prompts of `benchmarks/e2e.py`, greedy, in one process and one run: each round runs
every engine once on the same requests, so a busy machine slows them alike.

Engines: plain (``--draft none``); the EAGLE head routed; the block drafter with a fixed block
(every proposal verified: ``--no-route --k B-1``); the block drafter routed (the router's caps,
then the confidence cut over the profiled costs); and the modes that look up n-grams first:
n-gram routed, ``ngram+eagle`` routed and ``ngram+dspark`` routed (issue 35's copy-heavy bar:
``ngram+dspark`` at least the best existing mode). Every drafting engine has the same cap, k = 7
(the block's proposals). Batch 1 runs the prompts one at a time; batch 4 runs four at once (the
cut must not verify more than pays when the batch grows).

    python benchmarks/dspark.py [--rounds 2] [--max-tokens 64] [--batches 1,4] [--traffic open,copy]
                                [--block FOLDER] [--compare FOLDER ...] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from defaults import OPEN  # noqa: E402
from e2e import PROMPTS  # noqa: E402

import hal  # noqa: E402
from hal.drafters.kinds import make_drafter, parse_draft  # noqa: E402
from hal.engine.requests import Request  # noqa: E402
from hal.launch.build import build_engine  # noqa: E402
from hal.models.fetch import load_model  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402
from hal.models.tokenizer import chatml  # noqa: E402

COPY = [p for _, kind, p in PROMPTS if kind == "copy"]


def engines(target, block: str | None, compare: list[str], quick: bool):
    """name -> engine; a routed engine profiles its costs (its drafter's included) in its own pool.
    ``compare``: more block drafter folders, each routed; ``quick``: no EAGLE head, no fixed block."""
    be = target.be
    dspark = parse_draft(f"dspark:{block}" if block else "dspark")
    out = {"plain": build_engine(target, None)}
    fixed = make_drafter(dspark, be, target, "smollm2-135m")
    if not quick:
        out["eagle routed"] = build_engine(target, make_drafter(parse_draft("eagle"), be, target, "smollm2-135m"),
                                           k=7, route=True)
        out[f"dspark fixed k={fixed.model.proposals}"] = build_engine(target, fixed, k=fixed.model.proposals)
    out["dspark routed"] = build_engine(target, make_drafter(dspark, be, target, "smollm2-135m"),
                                        k=fixed.model.proposals, route=True)
    if not quick:
        for kind in ("ngram", "ngram+eagle", f"ngram+dspark:{block}" if block else "ngram+dspark"):
            out[f"{kind.split(':')[0]} routed"] = build_engine(
                target, make_drafter(parse_draft(kind), be, target, "smollm2-135m"), k=fixed.model.proposals,
                route=True)
    for folder in compare:
        other = make_drafter(parse_draft(f"dspark:{folder}"), be, target, "smollm2-135m")
        out[f"dspark routed ({Path(folder).name})"] = build_engine(target, other, k=other.model.proposals,
                                                                  route=True)
    return out


def run(dec, ids: list[list[int]], max_tokens: int, k: int, stop) -> tuple[int, float]:
    t = time.perf_counter()
    got = dec.generate([Request(p, max_new_tokens=max_tokens, k=k, stop_ids=stop) for p in ids])
    return sum(len(g) for g in got), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--traffic", default="open,copy", help="which prompts: open, copy or both")
    ap.add_argument("--block", help="a block drafter folder (default: the shipped one)")
    ap.add_argument("--compare", action="append", default=[], metavar="FOLDER",
                    help="another block drafter folder, routed beside the first (repeatable)")
    ap.add_argument("--quick", action="store_true", help="plain and routed block drafters only")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    decs = engines(target, args.block, args.compare, args.quick)
    stop = target.cfg.stop_ids
    prompts = {"open": OPEN, "copy": COPY}
    if not set(args.traffic.split(",")) <= set(prompts):
        ap.error(f"--traffic: expected open, copy or open,copy, got {args.traffic}")
    traffic = {kind: [tok.encode(chatml(p)).ids for p in prompts[kind]] for kind in args.traffic.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    totals: dict = {}
    for _ in range(args.rounds):
        for kind, ids in traffic.items():
            for b in batches:
                for i in range(0, len(ids), b):
                    for name, dec in decs.items():
                        n, s = run(dec, ids[i:i + b], args.max_tokens, 0 if name == "plain" else 7, stop)
                        cell = totals.setdefault((kind, b, name), [0, 0.0])
                        cell[0], cell[1] = cell[0] + n, cell[1] + s
    lines = ["# DSpark block drafting: open-ended and copy-heavy prompts, greedy", "",
             f"`python benchmarks/dspark.py --rounds {args.rounds} --max-tokens {args.max_tokens} "
             f"--batches {args.batches}" + (f" --traffic {args.traffic}" if args.traffic != "open,copy" else "")
             + "".join(f" --compare {c}" for c in args.compare)
             + (" --quick" if args.quick else "") + f"`; {machine_line(target.plan)}; {time.strftime('%Y-%m-%d')}.", "",
             "| traffic | batch | engine | tokens | tok/s | vs plain | tokens/step | acceptance |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for (kind, b, name), (n, s) in totals.items():
        plain = totals[(kind, b, "plain")]
        m = decs[name].metrics.total
        lines.append(f"| {kind} | {b} | {name} | {n} | {n / s:.1f} | {(n / s) / (plain[0] / plain[1]):.2f}x | "
                     f"{m.mean_acceptance_length:.2f} | {m.acceptance_rate:.2f} |")
    lines += ["", "tokens/step and acceptance are each engine's totals over every traffic and batch."]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "dspark.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
