"""Choosing the block drafter's shape by measurement: block size, draft layers and tapped target
layers, each trained for the same minutes on the same cached data (`hal.training.block_data`),
then scored two ways:
- validation tau: the mean accepted length of the Markov-chained greedy block at random anchors
  of held-out training sequences (teacher-forced: exact up to the first miss);
- held-out engine acceptance: greedy decoding of prompts on topics never trained on
  (`hal.training.data.HELDOUT_TOPICS`) with the drafter verifying every proposal (k = its proposals), as
  the engine's mean acceptance length (tokens per verify step) and its acceptance by position.

    python benchmarks/dspark_sweep.py [--minutes 5] [--prompts 8] [--only NAME ...]

A config's ``distill`` is the share of the cross-entropy taken against the target's soft labels
(`hal.training.dspark_train.losses`; 0 when absent).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hal.models.machine import machine_line

CONFIGS = {   # name -> train-head --kind dspark options
    "B8 L2 taps5": dict(block=8, layers=2, taps=(1, 8, 16, 24, 29)),
    "B4 L2 taps5": dict(block=4, layers=2, taps=(1, 8, 16, 24, 29)),
    "B16 L2 taps5": dict(block=16, layers=2, taps=(1, 8, 16, 24, 29)),
    "B8 L1 taps5": dict(block=8, layers=1, taps=(1, 8, 16, 24, 29)),
    "B8 L2 taps3": dict(block=8, layers=2, taps=(1, 16, 29)),
    # the last layer's output as a tap (30 = SmolLM2-135M's layer count), and soft labels (stop 58)
    "B8 L1 taps3": dict(block=8, layers=1, taps=(1, 16, 29)),
    "B8 L1 taps 1/16/30": dict(block=8, layers=1, taps=(1, 16, 30)),
    "B8 L1 taps 1/16/29/30": dict(block=8, layers=1, taps=(1, 16, 29, 30)),
    "B8 L1 taps 1/16/30 distill": dict(block=8, layers=1, taps=(1, 16, 30), distill=1.0),
    "B8 L1 taps 1/16/30 distill 0.5": dict(block=8, layers=1, taps=(1, 16, 30), distill=0.5),
}   # (stop 79: DSparkConfig's defaults are DeepSpec's DSpark layout; the results before it trained spec-hal's
#      retired dspark-block layout, whose anchor row did not propose)


def heldout(target, tok, model, prompts: list[str], max_new_tokens: int) -> dict:
    """The engine's acceptance with ``model`` on ``prompts`` (greedy, k = its proposals, no router)."""
    from hal.drafters.dspark import DSparkDrafter
    from hal.engine import SpeculativeDecoder
    from hal.engine.requests import Request
    from hal.models.tokenizer import chatml
    dec = SpeculativeDecoder(target, DSparkDrafter(model))
    k = model.proposals
    t = time.perf_counter()
    dec.generate([Request(tok.encode(chatml(p)).ids, max_new_tokens=max_new_tokens, k=k,
                          stop_ids=target.cfg.stop_ids) for p in prompts])
    m = dec.metrics.total
    return {"tokens_per_step": m.mean_acceptance_length, "acceptance": m.acceptance_rate,
            "by_position": [round(a, 3) for a in m.acceptance_by_position()[:k]], "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--name", help="the result file's name under --out (default from --only)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--keep", default="/tmp/dspark-sweep", help="where each trained drafter is written")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from hal.models.dspark import DSparkConfig, DSparkModel
    from hal.training import block_data, data
    from hal.training.dspark_train import train_block
    blob = block_data.responses("smollm2-135m")
    feats = block_data.tapped("smollm2-135m", blob)
    target, tok = block_data.load_target("smollm2-135m", None, None)
    c = target.cfg
    prompts = data.prompts(heldout=True)[:args.prompts]
    rows = []
    for name, opts in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        shape = {k: v for k, v in opts.items() if k != "distill"}
        cfg = DSparkConfig(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                          rank=32, draft_vocab=8192, eps=c.eps, **shape)
        got = train_block(cfg, blob, feats, target, args.minutes, distill=opts.get("distill", 0.0),
                          mask_token=c.stop_ids[0], say=lambda line, n=name: print(n, line, flush=True))
        from hal.models.block_layouts import write_block
        write_block(Path(args.keep) / name.replace(" ", "-"), cfg, got["weights"], c.stop_ids[0], c.layers,
                    (target.embed, target.head), vocab=c.vocab)
        with torch.inference_mode():
            held = heldout(target, tok, DSparkModel(cfg, got["weights"], target), prompts, args.max_new_tokens)
        rows.append({"name": name, **opts, "steps": got["summary"]["steps"], "val": got["summary"]["val"], **held})
        print(json.dumps(rows[-1]), flush=True)
    lines = [f"# Block drafter shapes, {args.minutes:g} training minutes each", "",
             f"`python benchmarks/dspark_sweep.py --minutes {args.minutes:g} --prompts {args.prompts}"
             + (" --only " + " ".join(f"'{n}'" for n in args.only) if args.only else "") + "`; "
             f"{machine_line()}; {time.strftime('%Y-%m-%d')}.", "",
             "| shape | steps | val tau | val top-1 | held-out tokens/step | held-out acceptance | by position |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['steps']} | {r['val']['tau']:.2f} | {r['val']['top1']:.3f} | "
                     f"{r['tokens_per_step']:.2f} | {r['acceptance']:.3f} | {r['by_position']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or ("dspark-sweep.md" if not args.only else
                         f"dspark-sweep-{'-'.join(n.replace(' ', '') for n in args.only)}.md")
    (out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
