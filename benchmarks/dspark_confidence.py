"""How well block drafters' confidence heads predict acceptance on topics never trained on
(`hal.training.data.HELDOUT_TOPICS`): the target's greedy answers, its tapped features, and at
every response position a block whose proposals are scored teacher-forced, as in training
(`hal.training.confidence.samples`). Greedy and deterministic, so the numbers do not depend on
the machine's load. Lower BCE and Brier are better; a calibrated head's mean prediction is the
observed rate, bin by bin.

    python benchmarks/dspark_confidence.py [--prompts 24] [--max-new-tokens 64] [BLOCK_FOLDER ...]
    (default: the shipped block drafter)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hal
from hal.models.block_layouts import read_block
from hal.models.dspark import shipped_block
from hal.models.fetch import load_model
from hal.models.machine import machine_line
from hal.training import block_data, data
from hal.training.block_data import CANDIDATE_TAPS, to_draft_of
from hal.training.block_data import BlockData
from hal.training.dspark_train import from_weights
from hal.training.confidence import samples

BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """Chance that a right position is ranked above a wrong one (ties count half)."""
    _, at, counts = torch.unique(p, return_inverse=True, return_counts=True)
    ranks = (counts.cumsum(0) - (counts - 1) / 2).to(p.dtype)[at]      # 1-based, ties averaged
    n1 = y.sum()
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * (len(y) - n1)))


def scores(folder: Path, target, blob: dict, feats) -> tuple[dict, list]:
    layout, cfg, w = read_block(folder, target)
    d = BlockData(blob, feats, [CANDIDATE_TAPS.index(t) for t in cfg.taps], cfg.draft_vocab, target.cfg.stop_ids, 0)
    d.val = d.val + d.tr                     # every held-out answer is scored
    model = from_weights(cfg, w, target, layout.mask_token)
    x, y = samples(model, d, d.val, to_draft_of(w["draft_ids"], target.cfg.vocab))
    logit = x @ w["conf"].double() + w["conf_bias"].double()
    p = torch.sigmoid(logit)
    out = {"positions": len(y), "right": float(y.mean()), "predicted": float(p.mean()),
           "bce": float(torch.nn.functional.binary_cross_entropy_with_logits(logit, y)),
           "brier": float(((p - y) ** 2).mean()), "auc": auc(p, y)}
    bins = []
    for lo, hi in zip(BINS, BINS[1:]):
        inside = (p >= lo) & ((p < hi) | (hi == 1.0))
        bins.append((lo, hi, int(inside.sum()), float(p[inside].mean()) if inside.any() else None,
                     float(y[inside].mean()) if inside.any() else None))
    return out, bins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/dspark-confidence.md")
    ap.add_argument("blocks", nargs="*", help="block drafter folders (default: the shipped one)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    texts = data.prompts(heldout=True)[:args.prompts]
    seqs = data.generate(target, tok, texts, args.max_new_tokens)
    from hal.models.tokenizer import chatml
    blob = {"ids": seqs, "prompt_lens": [len(tok.encode(chatml(t)).ids) for t in texts], "texts": texts}
    feats = block_data.record(target, seqs)
    lines = ["# Confidence heads on held-out topics (teacher-forced, every response position)", "",
             f"`python benchmarks/dspark_confidence.py --prompts {args.prompts} --max-new-tokens "
             f"{args.max_new_tokens} {' '.join(args.blocks)}`; {machine_line(target.plan)}; "
             f"{time.strftime('%Y-%m-%d')}.", "",
             "| drafter | positions | right | mean predicted | BCE | Brier | AUC |", "|---|---:|---:|---:|---:|---:|---:|"]
    reliability = []
    for folder in [Path(b) for b in args.blocks] or [shipped_block("smollm2-135m")]:
        s, bins = scores(folder, target, blob, feats)
        lines.append(f"| {folder} | {s['positions']} | {s['right']:.3f} | {s['predicted']:.3f} | {s['bce']:.3f} | "
                     f"{s['brier']:.3f} | {s['auc']:.3f} |")
        reliability += [f"| {folder} | {lo:.1f}-{hi:.1f} | {n} | " + (f"{mp:.3f} | {ob:.3f} |" if n else "- | - |")
                        for lo, hi, n, mp, ob in bins]
    lines += ["", "Reliability (positions by predicted acceptance):", "",
              "| drafter | predicted | positions | mean predicted | right |", "|---|---|---:|---:|---:|"] + reliability
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
