"""Does DeepSpec's own code read the DSpark drafters spec-hal writes (`write_block`, what
``train-head --kind dspark --layout dspark`` writes), and propose what spec-hal proposes?

A drafter with random weights (`hal.training.dspark_train.DSparkTrain` in the published
architecture: 2 Qwen3 layers, block 7, mask id 250, taps of target layers [0, 2], a Markov table of
rank 8, a confidence head over [h, markov_w1]) for the DSpark fixture's tiny Qwen3 target
(`tests/fixtures/drafters/dspark/tiny_target`) is written to a temporary folder. DeepSpec's
``Qwen3DSparkModel.from_pretrained`` loads it and proposes one block right after prefill as its
evaluator does (`dspark_reference.single_block`); spec-hal loads the same folder (`load_block`) and
proposes from the same prompt. Writes the comparison to ``benchmarks/results/dspark-written-check.md``.

Reference: deepseek-ai/DeepSpec @ afdfa7c9382a3341a3e6f17756dd816da79f132c (as `dspark_reference.py`)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dspark_written_check.py --src /tmp/src_dspark
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

__import__("sys").path.insert(0, str(Path(__file__).parent))

import dspark_reference as ref  # noqa: E402
from written_common import REPO, block_proposal, parse, report  # noqa: E402


def main():
    args = parse(__doc__, "dspark-written-check", "checkout of deepseek-ai/DeepSpec (contains deepspec/)")
    r = ref.load_reference(args.src)
    from transformers import AutoModelForCausalLM

    import hal
    from hal.drafters.dspark import DSparkDrafter
    from hal.models.block_layouts import DSPARK, load_block, write_block
    from hal.models.dspark import Confidence, DSparkConfig
    from hal.models.fetch import load_model
    from hal.training.dspark_train import DSparkTrain

    target_dir = REPO / "tests/fixtures/drafters/dspark/tiny_target"
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours, _ = load_model(str(target_dir), hal.get_backend("cpu"))
    c = ours.cfg
    cfg = DSparkConfig(hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                       layers=ref.DRAFT_LAYERS, taps=tuple(i + 1 for i in ref.TARGET_LAYER_IDS), block=ref.BLOCK,
                       rank=ref.MARKOV_RANK, draft_vocab=c.vocab, rope_base=10000.0, eps=c.eps)
    cfg = replace(cfg, anchor_predicts=True, confidence=Confidence.MARKOV)
    embed, head = ours.embed.half().float(), ours.head.half().float()   # the copies a DSpark folder ships (fp16)
    m = DSparkTrain(cfg, embed, head, torch.arange(c.vocab), seed=3, mask_token=ref.MASK_ID)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in m.p.items():
            if name != "mask":
                big = any(w in name for w in ("norm", "conf", "markov"))
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if big else 0.1))
    prompt = torch.randint(0, 240, (1, 12), generator=torch.Generator().manual_seed(1234))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        assert write_block(folder, cfg, m.weights(), ref.MASK_ID, c.layers, (embed, head)) == DSPARK
        draft = r.Model.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
        theirs = ref.single_block(r, hf, draft, prompt)
        model = load_block(folder, ours)
    n, anchor = prompt.shape[1], int(theirs["anchor_token"])
    ids = prompt[0].tolist() + [anchor]
    drafter = DSparkDrafter(model)
    p = block_proposal(drafter, ours, ids, n, cfg.taps, ref.BLOCK)
    mine, want = p.draft_token_ids.tolist(), theirs["draft_tokens"][0].tolist()
    conf = torch.tensor(drafter.confidences[0])
    dconf = (conf - theirs["confidence"][0]).abs().max().item()
    ok = mine == want and dconf < 1e-4
    lines = ["# DSpark drafters spec-hal writes, read by DeepSpec's code", "",
             f"Command: `OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dspark_written_check.py --src "
             f"/tmp/src_dspark` ({time.strftime('%Y-%m-%d')}); reference deepseek-ai/DeepSpec @ {ref.COMMIT}.", "",
             "A random-weight drafter (`DSparkTrain`, the published architecture) for the tiny Qwen3 target of "
             "`tests/fixtures/drafters/dspark`, written by `write_block` (fp16, with the target's embeddings and "
             "lm_head), loaded by DeepSpec's `Qwen3DSparkModel.from_pretrained` and by spec-hal's `load_block`; "
             "each proposes one greedy block of 7 after the same 12-token prompt.", "",
             "| | tokens | confidences | max abs confidence difference |", "|---|---|---|---:|",
             f"| DeepSpec `Qwen3DSparkModel` | {want} | {[round(x, 4) for x in theirs['confidence'][0].tolist()]} | |",
             f"| spec-hal `DSparkModel` | {mine} | {[round(x, 4) for x in conf.tolist()]} | {dconf:.2e} |", "",
             f"Result: {'same block' if ok else 'DIFFERENT'} (confidences within 1e-4).", ""]
    report(args.out, lines, ok)


if __name__ == "__main__":
    main()
