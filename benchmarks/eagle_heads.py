"""EAGLE heads side by side on SmolLM2-135M, in one run: each head folder drafting a fixed chain of
``--k`` tokens, and under the default routed ``ngram+eagle``, against plain decoding, greedy, on
held-out open-ended prompts (`hal.training.data` held-out topics: never trained on) and on the
copy-heavy prompts of `benchmarks/e2e.py`. Engines are built and runs alternate prompt by
prompt (plain, then each head), each request ``--reps`` times, the least time kept.

Per head and prompt group: decode speed against plain (geometric mean over the prompts), tokens
per target step of the fixed chain (accepted + 1), and each chain position's acceptance.

    python benchmarks/eagle_heads.py [--prompts 8] [--k 4] OLD_FOLDER NEW_FOLDER ...
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
from hal.drafters.eagle import EagleDrafter, NgramOrHead
from hal.engine import Request, SpeculativeDecoder
from hal.engine.router import Router
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/eagle-heads.md")
    args = ap.parse_args()
    torch.set_num_threads(2)
    be = hal.get_backend("cpu")
    target, tok = load_model("smollm2-135m", be, "auto")   # the plan that serves by default
    heads = [(Path(h).name, load_eagle(h, target)) for h in args.heads]
    groups = {"open (held-out)": [chatml(t) for t in data.prompts(heldout=True)[:args.prompts]],
              "copy": [chatml(p) for _, g, p in COPY if g == "copy"]}
    n, k = args.max_new_tokens, args.k
    with torch.inference_mode():
        costs = {name: SpeculativeDecoder(target, NgramOrHead(NgramDrafter(be, min_n=2), EagleDrafter(h)),
                                          num_blocks=256).profile_costs(max_tokens=k + 3, context=200)
                 for name, h in heads}
        rows = {}
        for group, texts in groups.items():
            for text in texts:
                ids = tok.encode(text).ids
                best: dict[str, float] = {}
                outs, stats = {}, {}
                for _ in range(args.reps):
                    for name, make, kk, c in [("plain", lambda: None, 0, None)] + [
                            (f"{hn} k={k}", lambda h=h: EagleDrafter(h), k, None) for hn, h in heads] + [
                            (f"{hn} ngram+eagle routed", lambda h=h: NgramOrHead(NgramDrafter(be, min_n=2),
                                                                                   EagleDrafter(h)), k + 2, costs[hn])
                            for hn, h in heads]:
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
                        have = r.setdefault(key, [0] * (k + 2))
                        for j, x in enumerate(got[:k + 2]):
                            have[j] += x
    lines = ["# EAGLE heads side by side", "",
             f"Command: `python benchmarks/eagle_heads.py --prompts {args.prompts} --k {k} --max-new-tokens {n} "
             f"--reps {args.reps} {' '.join(args.heads)}`; {time.strftime('%Y-%m-%d %H:%M')}; "
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
