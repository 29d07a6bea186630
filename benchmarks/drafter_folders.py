"""Drafter folders side by side on SmolLM2-135M, in one run (named ``eagle_heads.py`` before stop
79): each folder drafting alone with a fixed k (an EAGLE head: a chain of ``--k``; a block drafter:
its whole block), and under the default routed ``ngram+eagle`` or ``ngram+dspark`` (k <= 6, the
router's costs profiled per folder), against plain decoding, greedy, on
held-out open-ended prompts (`hal.training.data` held-out topics: never trained on) and on the
copy-heavy prompts of `benchmarks/e2e.py`. Engines are built and runs alternate prompt by
prompt (plain, then each folder), each request ``--reps`` times, the least time kept. A folder's
kind comes from its config (`hal.models.block_layouts.read_layout` reads block drafters).

Per folder and prompt group: decode speed against plain (geometric mean over the prompts), tokens
per target step (accepted + 1), and each draft position's acceptance.

    python benchmarks/drafter_folders.py [--prompts 8] [--k 4] OLD_FOLDER NEW_FOLDER ...
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import hal
from hal.drafters import NgramDrafter
from hal.drafters.dspark import DSparkDrafter
from hal.drafters.eagle import EagleDrafter, NgramOrHead
from hal.engine import Request, SpeculativeDecoder
from hal.engine.router import Router
from hal.errors import HalError
from hal.models.block_layouts import load_block, read_layout
from hal.models.eagle_layouts import load_eagle
from hal.models.fetch import load_model
from hal.models.machine import machine_line
from hal.models.tokenizer import chatml
from hal.training import data

sys.path.insert(0, str(Path(__file__).parent))
from e2e import PROMPTS as COPY  # noqa: E402


def run(target, drafter, ids, n, k, costs=None):
    dec = SpeculativeDecoder(target, drafter, num_blocks=256)
    if costs is not None:
        dec.router = Router(costs, max_k=k)
    t = time.perf_counter()
    out = dec.generate([Request(ids, max_new_tokens=n, k=k, stop_ids=target.cfg.stop_ids)])[0]
    return out, time.perf_counter() - t, dec.metrics.total


ROUTED_K = 6   # the routed modes' cap (benchmarks/routing.py's)


def drafter_of(folder: str, target, k: int):
    """(label, a factory of a new drafter alone, its fixed k, the routed mode's name) for ``folder``."""
    try:
        read_layout(folder)
    except HalError:
        head = load_eagle(folder, target)
        return Path(folder).name, lambda: EagleDrafter(head), k, "ngram+eagle"
    block = load_block(folder, target)
    return Path(folder).name, lambda: DSparkDrafter(block), block.proposals, "ngram+dspark"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/drafter-folders.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    be = hal.get_backend("cpu")
    target, tok = load_model("smollm2-135m", be, "auto")   # the plan that serves by default
    folders = [drafter_of(f, target, args.k) for f in args.folders]
    groups = {"open (held-out)": [chatml(t) for t in data.prompts(heldout=True)[:args.prompts]],
              "copy": [chatml(p) for _, g, p in COPY if g == "copy"]}
    n, k = args.max_new_tokens, ROUTED_K
    with torch.inference_mode():
        costs = {name: SpeculativeDecoder(target, NgramOrHead(NgramDrafter(be, min_n=2), make()),
                                          num_blocks=256).profile_costs(max_tokens=k + 1, context=200)
                 for name, make, _, _ in folders}
        rows = {}
        for group, texts in groups.items():
            for text in texts:
                ids = tok.encode(text).ids
                best: dict[str, float] = {}
                outs, stats = {}, {}
                for _ in range(args.reps):
                    for name, make, kk, c in [("plain", lambda: None, 0, None)] + [
                            (f"{fn} k={fk}", make, fk, None) for fn, make, fk, _ in folders] + [
                            (f"{fn} {mode} routed", lambda make=make: NgramOrHead(NgramDrafter(be, min_n=2), make()),
                             k, costs[fn]) for fn, make, _, mode in folders]:
                        out, s, m = run(target, make(), ids, n, kk, c)
                        best[name] = min(best.get(name, s), s)
                        outs[name], stats[name] = out, m
                for name in best:
                    assert outs[name] == outs["plain"], (name, text[:40])   # greedy: identical to plain
                    r = rows.setdefault((group, name), {"ratio": [], "steps": 0, "tokens": 0})
                    r["ratio"].append(best["plain"] / best[name] if name != "plain" else len(outs[name]) / best[name])
                    st = stats[name]
                    r["steps"] += st.num_drafts
                    r["tokens"] += st.num_accepted_tokens + st.num_drafts
                    for key, got in (("acc", st.accepted_per_position), ("prop", st.drafts_per_position)):
                        have = r.setdefault(key, [0] * 8)
                        for j, x in enumerate(got[:8]):
                            have[j] += x
    lines = ["# Drafter folders side by side", "",
             f"Command: `python benchmarks/drafter_folders.py --prompts {args.prompts} --k {args.k} "
             f"--max-new-tokens {n} --reps {args.reps} {' '.join(args.folders)}`; {time.strftime('%Y-%m-%d %H:%M')}; "
             f"{machine_line(target.plan)}.", "",
             "Greedy outputs equal plain's for every row (asserted). Speed: plain's time over the row's (geometric "
             "mean over the group's prompts; the least of the reps). Tokens per step: (accepted + 1) per target "
             "verify with a draft. Acceptance per chain position: accepted there over proposed there.", "",
             "| group | engine | speed vs plain | tokens per step | acceptance per position |",
             "|---|---|---:|---:|---|"]
    for (group, name), r in rows.items():
        geo = math.exp(sum(math.log(x) for x in r["ratio"]) / len(r["ratio"]))
        if name == "plain":
            lines.append(f"| {group} | plain | {geo:.1f} tok/s | | |")
            continue
        per = ", ".join(f"{a / p:.2f}" for a, p in zip(r["acc"], r["prop"]) if p)
        tps = f"{r['tokens'] / r['steps']:.2f}" if r["steps"] else ""
        lines.append(f"| {group} | {name} | {geo:.3f}x | {tps} | {per} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
