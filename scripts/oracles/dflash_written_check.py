"""Does z-lab's own code read the DFlash drafters spec-hal writes (`write_block`, what
``train-head --kind dspark --layout dflash`` writes), and draft what spec-hal drafts?

A drafter with random weights (`hal.training.dspark_train.DSparkTrain` in DFlash's architecture:
2 Qwen3 layers, block 8, mask id 255, taps of target layers [0, 2, 4], no Markov or confidence
head) for the DFlash fixture's tiny Qwen3 target (`tests/fixtures/drafters/dflash/tiny_target`) is
written to a temporary folder. z-lab's ``DFlashDraftModel.from_pretrained`` loads it and drafts one
block from scratch (`dflash_reference.stateless_draft`: the target's features of the prefix, the
block [anchor, mask x 7], the target's lm_head); spec-hal loads the same folder (`load_block`) and
drafts the same block, greedily and at temperature 1. Writes the comparison to
``benchmarks/results/dflash-written-check.md``.

Reference: z-lab/dflash @ 44947fbf71114e241c96de194f4b382b5dd330d0 (as `dflash_reference.py`)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dflash_written_check.py --src /tmp/src_dflash
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

__import__("sys").path.insert(0, str(Path(__file__).parent))

import dflash_reference as ref  # noqa: E402
from written_common import REPO, block_proposal, parse, report  # noqa: E402


def main():
    args = parse(__doc__, "dflash-written-check", "checkout of z-lab/dflash (contains dflash/)")
    r = ref.load_reference(args.src)
    from transformers import Qwen3ForCausalLM

    import hal
    from hal.drafters.dspark import DSparkDrafter
    from hal.models.block_layouts import DFLASH, load_block, write_block
    from hal.models.dspark import Confidence, DSparkConfig
    from hal.models.fetch import load_model
    from hal.training.dspark_train import DSparkTrain

    target_dir = REPO / "tests/fixtures/drafters/dflash/tiny_target"
    hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ours, _ = load_model(str(target_dir), hal.get_backend("cpu"))
    c = ours.cfg
    cfg = DSparkConfig(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=96,
                       layers=2, taps=tuple(i + 1 for i in ref.TARGET_LAYER_IDS), block=ref.BLOCK_SIZE, rank=0,
                       draft_vocab=c.vocab, rope_base=10000.0, eps=c.eps)
    cfg = replace(cfg, anchor_predicts=False, confidence=Confidence.NONE)
    m = DSparkTrain(cfg, ours.embed, ours.head, torch.arange(c.vocab), seed=3, mask_token=ref.MASK_TOKEN_ID)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in m.p.items():
            if name != "mask":
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    seq = torch.tensor([ref.PROMPT])
    P = len(ref.PROMPT) - 1          # the block starts at the prompt's last token (the anchor)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        assert write_block(folder, cfg, m.weights(), ref.MASK_TOKEN_ID, c.layers) == DFLASH
        draft = r.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32).eval()
        theirs = ref.stateless_draft(r, draft, hf, seq, P)
        model = load_block(folder, ours)
    got = {temp: block_proposal(DSparkDrafter(model), ours, ref.PROMPT, P, cfg.taps, ref.BLOCK_SIZE - 1, temp)
           for temp in (0.0, 1.0)}
    mine, want = got[0.0].draft_token_ids.tolist(), theirs["draft_tokens"][0].tolist()
    dq = (got[1.0].draft_probs - torch.softmax(theirs["draft_logits"][0], -1)).abs().max().item()
    ok = mine == want and dq < 1e-5
    lines = ["# DFlash drafters spec-hal writes, read by z-lab's code", "",
             f"Command: `OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dflash_written_check.py --src "
             f"/tmp/src_dflash` ({time.strftime('%Y-%m-%d')}); reference z-lab/dflash @ {ref.COMMIT}.", "",
             "A random-weight drafter (`DSparkTrain`, DFlash's architecture) for the tiny Qwen3 target of "
             "`tests/fixtures/drafters/dflash`, written by `write_block` (fp16; the target's embeddings and "
             "lm_head borrowed), loaded by z-lab's `DFlashDraftModel.from_pretrained` and by spec-hal's "
             "`load_block`; each drafts the block after the same 12-token prompt.", "",
             "| | greedy tokens | max abs difference of the draft probabilities at temperature 1 |", "|---|---|---:|",
             f"| z-lab `DFlashDraftModel` | {want} | |",
             f"| spec-hal `DSparkModel` | {mine} | {dq:.2e} |", "",
             f"Result: {'same block' if ok else 'DIFFERENT'} (probabilities within 1e-5).", ""]
    report(args.out, lines, ok)


if __name__ == "__main__":
    main()
