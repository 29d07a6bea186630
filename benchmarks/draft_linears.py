"""A drafter's forward with its linears through the target's plan (issue 37 item 3) against
plain ``F.linear`` / `lm_head`, side by side in one run: the shipped EAGLE head (one chained
draft step: one row per request) and the shipped block drafter (one block: B rows per
request), at 1 and 4 requests over 128 cached positions. Under a q4q8 plan the drafters'
weights run as Q8 tiles (`hal.models.llama.Llama.draft_weight`); a third variant then keeps
them float in the plan's dtype, through the plan. The variants alternate forward by forward;
medians of ``--reps`` each.

    python benchmarks/draft_linears.py [--reps 60] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import hal
from hal import kv
from hal.drafters.kinds import make_drafter, parse_draft
from hal.engine.forward import make_batch
from hal.models.fetch import load_model
from hal.models.llama import lm_head, plain_linear
from hal.models.machine import machine_line

CONTEXT = 128


def head_step(head, R: int):
    """A closure running one chained head step for R requests of CONTEXT cached positions."""
    pool = kv.KVPool(head.be, 64, 16, head.cfg.kv_heads, head.cfg.head_dim, num_layers=1)
    seqs = [pool.sequence() for _ in range(R)]
    for s in seqs:
        s.reserve(CONTEXT)
        s.commit(CONTEXT)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, head.vocab, (R,), generator=g)
    x = torch.randn(R, head.cfg.hidden, generator=g)

    def once():
        b = make_batch(head.be, head.device, pool, seqs, [1] * R, tokens)
        head.forward(b, pool.k[0], pool.v[0], tokens, x, False)
    return once


def block_step(drafter, R: int):
    """A closure running one block forward (B rows each, no new context) for R requests."""
    m = drafter.model
    B = m.cfg.block
    pool = kv.KVPool(m.be, 64, 16, m.cfg.kv_heads, m.cfg.head_dim, num_layers=m.cfg.layers)
    seqs = [pool.sequence() for _ in range(R)]
    for s in seqs:
        s.reserve(CONTEXT)
        s.commit(CONTEXT)
    g = torch.Generator().manual_seed(0)
    anchors = torch.randint(0, m.vocab, (R,), generator=g)
    feats = torch.zeros(0, len(m.cfg.taps) * m.cfg.hidden)
    empty = torch.zeros(0, dtype=torch.long)
    rows = torch.arange(R * B)

    def once():
        b = make_batch(m.be, m.device, pool, seqs, [B] * R, torch.zeros(R * B, dtype=torch.long), all_rows=True)
        m.forward(b, pool.k, pool.v, feats, empty, rows, anchors, b)
    return once


def plain(model):
    """The same drafter object with plain F.linear / lm_head (what ran before item 3; its
    weights float)."""
    model.linear, model.head_mm, model.linears = plain_linear, lm_head, "plain F.linear"
    return model


def interleaved(fns, reps: int) -> list[float]:
    """Median ms of each of ``fns``, run in turn ``reps`` times."""
    times = [[] for _ in fns]
    for f in fns:
        f()
    for _ in range(reps):
        for f, t in zip(fns, times):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def float_weights(target, build):
    """What ``build()`` makes with the drafter's weights kept float in the plan's dtype."""
    target.draft_weight = lambda w, device: w.to(target.dtype)
    try:
        return build()
    finally:
        del target.draft_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    be = hal.get_backend("cpu")
    target, _ = load_model("smollm2-135m", be, "auto")
    head = make_drafter(parse_draft("eagle"), be, target, "smollm2-135m").head
    head_plain = plain(float_weights(target, lambda: make_drafter(parse_draft("eagle"), be, target,
                                                                   "smollm2-135m").head))
    block = make_drafter(parse_draft("dspark"), be, target, "smollm2-135m")
    block_plain = float_weights(target, lambda: make_drafter(parse_draft("dspark"), be, target, "smollm2-135m"))
    plain(block_plain.model)
    q4q8 = target.plan.weights == "q4q8"
    head_float = float_weights(target, lambda: make_drafter(parse_draft("eagle"), be, target, "smollm2-135m").head)
    block_float = float_weights(target, lambda: make_drafter(parse_draft("dspark"), be, target, "smollm2-135m"))
    lines = ["# A drafter's linears through the target's plan against plain F.linear (issue 37 item 3)", "",
             f"Command: `python benchmarks/draft_linears.py --reps {args.reps} --threads {args.threads}`; "
             f"{machine_line(target.plan, args.threads)}; {time.strftime('%Y-%m-%d')}. Medians of {args.reps} "
             f"forwards each, the two variants alternating; {CONTEXT} cached positions per request.", "",
             "| drafter forward | requests | rows | through the plan ms | plain ms | plan / plain | "
             + ("float weights through the plan ms | Q8 tiles / float |" if q4q8 else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if q4q8 else "")]
    for name, make, a, b, c, rows in (("EAGLE head, one chained step", head_step, head, head_plain, head_float, 1),
                                      (f"block drafter, one block of {block.model.cfg.block}", block_step, block,
                                       block_plain, block_float, block.model.cfg.block)):
        for R in (1, 4):
            ms = interleaved([make(m, R) for m in ((a, b, c) if q4q8 else (a, b))], args.reps)
            lines.append(f"| {name} | {R} | {R * rows} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.3f} | "
                         + (f"{ms[2]:.2f} | {ms[0] / ms[2]:.3f} |" if q4q8 else ""))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    with torch.inference_mode():   # as the engine's steps run (`SpeculativeDecoder.step`)
        main()
