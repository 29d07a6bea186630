"""An EAGLE head's top-1 agreement with the target on text it never saw: the target's greedy
answers to the held-out-topic prompts (`hal.training.data.HELDOUT_TOPICS`) and two benchmark-like
chat prompts, each scored as the head's first draft from the target's true features (one
from-scratch forward per sequence), over the response tokens only.

    python benchmarks/head_heldout.py [--prompts 24] [HEAD_FOLDER ...]   (default: the shipped head)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hal
from hal.models.machine import machine_line
from hal import kv
from hal.training import data as eagle_data
from hal.models.eagle import shipped_head
from hal.models.eagle_layouts import load_eagle
from hal.models.fetch import load_model
from hal.engine.forward import make_batch
from hal.models.tokenizer import chatml

EXTRA = ["What are some fun things to do on a rainy weekend?", "Give me three tips for a good night's sleep."]


def agreement(head, seqs, feats, prompt_lens) -> tuple[int, int]:
    hits = n = 0
    for ids, f, p in zip(seqs, feats, prompt_lens):
        pool = kv.KVPool(head.be, -(-len(ids) // 16) + 1, 16, head.cfg.kv_heads, head.cfg.head_dim, num_layers=1)
        toks = torch.tensor(ids[1:])
        b = make_batch(head.be, head.device, pool, [pool.sequence()], [len(toks)], toks, all_rows=True)
        logits, _ = head.forward(b, pool.k[0], pool.v[0], toks, f[:len(toks)].float(), True)
        pred = logits.argmax(-1) if head.draft_ids is None else head.draft_ids[logits.argmax(-1)]
        ok = (pred[:-1] == torch.tensor(ids[2:]))[p - 1:]      # pair t predicts token t + 2; responses only
        hits, n = hits + int(ok.sum()), n + len(ok)
    return hits, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="*")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"))
    texts = eagle_data.prompts(heldout=True)[:args.prompts] + EXTRA
    with torch.inference_mode():
        target.batch_invariant = False
        seqs = eagle_data.generate(target, tok, texts, args.max_new_tokens)
        target.batch_invariant = True
        lens = [len(tok.encode(chatml(t)).ids) for t in texts]
        heads = [load_eagle(h, target) for h in args.heads or [str(shipped_head("smollm2-135m"))]]
        feats = {taps: eagle_data.features(target, seqs, layers=taps) for taps in {h.feature_layers for h in heads}}
        rows = [(h, *agreement(head, seqs, feats[head.feature_layers], lens))
                for h, head in zip(args.heads or ["shipped"], heads)]
    lines = ["# EAGLE head: top-1 agreement with the target on unseen text", "",
             f"Command: `python benchmarks/head_heldout.py --prompts {args.prompts}`; {time.strftime('%Y-%m-%d')}; "
             f"{len(texts)} prompts ({args.prompts} on held-out topics + {len(EXTRA)} benchmark-like chat prompts), "
             f"the target's greedy answers (<= {args.max_new_tokens} tokens), first draft from the true features; "
             f"{machine_line(target.plan)}.", "",
             "| head | response tokens | top-1 agreement |", "|---|---:|---:|"]
    lines += [f"| {Path(h).name} | {n} | {a / n:.3f} |" for h, a, n in rows]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "head-heldout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
