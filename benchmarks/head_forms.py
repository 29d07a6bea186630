"""The lm_head's two forms under one int4 plan, end to end (`hal.models.linear_layout.LinearPlan.head`):
the Q8_0 codes as stored (two int4 halves) against the float head in the plan's dtype, on the
end-to-end benchmark's prompts, plain decoding and routed speculation (``--draft``, default
``ngram+eagle``: the CLI's default), greedy. The plan chooses the head by a fixed decode/verify
mix of forward costs; this measures what that choice does where the router decides how much
is verified. Each output must equal its own plain greedy output (checked); tokens/s are medians
of interleaved runs. Writes benchmarks/results/head-forms.md.

    python benchmarks/head_forms.py [--reps 2] [--max-new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.e2e import PROMPTS  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from hal.drafters.kinds import make_drafter, parse_draft  # noqa: E402
from hal.engine import Request  # noqa: E402
from hal.engine.router import profile_costs  # noqa: E402
from hal.launch.build import build_engine, target_pool  # noqa: E402
from hal.models.fetch import fetch  # noqa: E402
from hal.models.linear_layout import HEADS  # noqa: E402
from hal.models.loaders import load_gguf  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402
from hal.models.tokenizer import chatml  # noqa: E402


def once(model, draft: str | None, costs, ids, n: int) -> tuple[list[int], float]:
    """One greedy generation (routed with ``costs`` when drafting); its output and seconds."""
    drafter = None if draft is None else make_drafter(parse_draft(draft), model.be, model, "smollm2-135m")
    dec = build_engine(model, drafter, k=8, route=drafter is not None, costs=costs, num_blocks=256)
    t = time.perf_counter()
    out = dec.generate([Request(ids, max_new_tokens=n, k=8 if drafter else 0, stop_ids=(2,))])[0]
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default="ngram+eagle")
    ap.add_argument("--out", default="benchmarks/results/head-forms.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path, be = fetch("smollm2-135m"), hal.get_backend("cpu")
    chosen = load_gguf(path, be, "auto")[0].plan
    if chosen.weights != "int4":   # nothing to compare: say so (make bench goes on)
        publish(["# The lm_head's two forms", "", f"{machine_line()}: plan `auto` chose {chosen.describe()}; the "
                 "head's form is chosen only under an int4 plan, so there is one form here."], args.out)
        return
    models = {head: load_gguf(path, be, plan=replace(chosen, head=head)) for head in HEADS}
    tok = models["float"][1]
    with torch.inference_mode():
        costs = {h: profile_costs(m, make_drafter(parse_draft(args.draft), be, m, "smollm2-135m"),
                                  target_pool(m, 256)) for h, (m, _) in models.items()}
        rows = [measure(models, costs, tok.encode(chatml(text)).ids, label, args) for label, _, text in PROMPTS]
    publish(table(rows, chosen, args), args.out)


def measure(models, costs, ids, label: str, args) -> tuple[str, dict]:
    """tok/s per (head, mode), medians of ``args.reps`` interleaved rounds after one warm-up."""
    modes = [(h, d) for h in models for d in (None, args.draft)]
    times, plain = {m: [] for m in modes}, {}
    for rep in range(args.reps + 1):
        for head, draft in modes:
            model = models[head][0]
            out, dt = once(model, draft, costs[head], ids, args.max_new_tokens)
            plain.setdefault(head, out if draft is None else None)
            if draft is not None and out != plain[head]:
                raise SystemExit(f"{label}: head {head}, {draft}: output differs from its plain greedy output")
            if rep:
                times[(head, draft)].append(len(out) / dt)
    return label, {m: statistics.median(v) for m, v in times.items()}


def table(rows, chosen, args) -> list[str]:
    d = args.draft
    lines = ["# The lm_head's two forms under one int4 plan, end to end", "",
             f"Command: `python benchmarks/head_forms.py --reps {args.reps} --max-new-tokens {args.max_new_tokens} "
             f"--threads {args.threads} --draft {d}`; {time.strftime('%Y-%m-%d')}; {machine_line()}; plan `auto` "
             f"chose: {chosen.describe()}. Greedy; routed with costs profiled per head; each output equal to its "
             f"own plain greedy output (checked). tok/s, medians of {args.reps} interleaved runs.", "",
             f"| prompt | plain, head float | plain, head Q8_0 | Q8_0 / float | {d}, head float | {d}, head Q8_0 | "
             "Q8_0 / float |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, t in rows:
        pf, pq, sf, sq = t[("float", None)], t[("q8_0", None)], t[("float", d)], t[("q8_0", d)]
        lines.append(f"| {label} | {pf:.1f} | {pq:.1f} | {pq / pf:.2f} | {sf:.1f} | {sq:.1f} | {sq / sf:.2f} |")
    return lines


if __name__ == "__main__":
    main()
