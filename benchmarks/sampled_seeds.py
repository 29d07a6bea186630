"""Sampled routing over many seeds: a sampled request's speed depends on the path its draws take (a
copy-heavy request that wanders off its source stops matching), so a few seeds say little of a
router. For each ``mode:group`` (group ``open`` or ``copy``: benchmarks/routing.py's prompts),
every prompt with ``--seeds`` seeds, plain and routed each on a fresh engine (no route memory:
each engine learns afresh), in alternating order; reported: the geometric mean of routed over plain
tokens per second, and the routed engines' mean steps per request. Runs against whatever ``hal`` is
on the path, so an older tree can be measured with this script (``PYTHONPATH=<tree>``).

    python benchmarks/sampled_seeds.py [--temperature 0.7] [--seeds 4] [--out FILE] ngram+eagle:open ngram:copy ...
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from routing import COPY, OPEN, bundled, publish  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="mode:group, group open or copy")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be, model, tok, template = bundled("0")   # no route memory: each engine learns afresh
    import hal
    from hal.cli import measured_costs
    from hal.engine import Request
    from hal.launch.build import build_engine, cli_drafter, local_pool
    from hal.models.machine import machine_line
    from hal.models.tokenizer import prompt_ids
    tree = Path(hal.__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or f"{tree} (not a git checkout)"
    rows = []
    for spec in args.specs:
        mode, group = spec.split(":")
        prompts = COPY if group == "copy" else OPEN
        costs = measured_costs(model, cli_drafter(mode, model, be), max_tokens=7)
        ratios, steps = [], []
        for s in range(args.seeds):
            for i, p in enumerate(prompts):
                ids, took = prompt_ids(tok, template, p), {}
                for m in (("none", mode) if (s + i) % 2 == 0 else (mode, "none")):
                    drafter = None if m == "none" else cli_drafter(mode, model, be)
                    e = build_engine(model, drafter, k=6, route=drafter is not None, costs=costs if drafter else None,
                                     pool=local_pool(model, 1, 1100 + args.max_tokens, 6))
                    t0 = time.perf_counter()
                    out = e.generate([Request(ids, max_new_tokens=args.max_tokens, temperature=args.temperature,
                                              seed=1000 * s + i, k=6 if drafter else 0)])[0]
                    took[m] = (time.perf_counter() - t0) / len(out)
                    if drafter is not None:
                        steps.append(e.steps)
                ratios.append(took["none"] / took[mode])
        gm = math.exp(statistics.mean(map(math.log, ratios)))
        rows.append(f"| {mode} | {group} | {len(ratios)} | {gm:.3f}x | {statistics.mean(steps):.1f} |")
        print(rows[-1], flush=True)
    cmd = "python benchmarks/sampled_seeds.py " + " ".join(sys.argv[1:])
    publish([f"# Sampled routing over seeds, {time.strftime('%Y-%m-%d')}", "",
             f"Command: `{cmd}`, `hal` from the tree at {head}. {machine_line(model.plan)}. Bundled "
             f"SmolLM2-135M, T={args.temperature}, {args.max_tokens} new tokens, k <= 6 routed, fresh "
             "engines without route memory, one run each (alternating).", "",
             "| mode | prompts | requests | routed / plain speed (geomean) | routed steps per request |",
             "|---|---|---|---|---|", *rows], args.out)


if __name__ == "__main__":
    main()
