"""Does SafeAILab's own code read the EAGLE-3 heads spec-hal writes (`write_eagle3`, what
``train-head --kind eagle`` writes), and draft what spec-hal drafts from them?

A head with random weights (`hal.training.eagle_train.EagleTrain`, every norm away from 1) for the
EAGLE-3 fixture's tiny Llama target (`tests/fixtures/drafters/eagle3/tiny_target`, 8 layers, taps
(2, 4, 5)) is written to a temporary folder as model.safetensors + config.json. The authors'
``cnets.Model`` loads it as ``eagle/model/ea_model.py`` does (config by ``EConfig``, embeddings
from the target, the state dict with strict=False) and drafts a greedy chain of 4 with their
forward (`eagle3_reference.authors_chain`). spec-hal loads the same folder (`load_eagle`) and
drafts the same chain from the same target features. Writes the comparison to
``benchmarks/results/eagle3-written-check.md``.

Reference: SafeAILab/EAGLE @ cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b (as `eagle3_reference.py`)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/eagle3_written_check.py --src /tmp/src_eagle3
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

__import__("sys").path.insert(0, str(Path(__file__).parent))

import eagle3_reference as ref  # noqa: E402
from written_common import REPO, parse, report  # noqa: E402


def main():
    args = parse(__doc__, "eagle3-written-check", "checkout of SafeAILab/EAGLE (contains eagle/model/)")
    torch.set_grad_enabled(False)
    cnets, EConfig = ref.load_reference(args.src)
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    import hal
    from hal import kv
    from hal.engine.forward import make_batch
    from hal.models.eagle import EagleConfig
    from hal.models.eagle_layouts import load_eagle, write_eagle3
    from hal.models.fetch import load_model
    from hal.training.eagle_train import EagleTrain, eagle3_taps

    target_dir = REPO / "tests/fixtures/drafters/eagle3/tiny_target"
    hf = LlamaForCausalLM.from_pretrained(target_dir).float().eval()
    ours, _ = load_model(str(target_dir), hal.get_backend("cpu"))
    ids = torch.tensor([ref.PROMPT])
    aux, _, token0, _ = ref.target_features(hf, ids)
    c = ours.cfg
    cfg = EagleConfig(version=3, hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, ffn=c.ffn,
                      rope_base=10000.0, eps=c.eps, feature_layers=eagle3_taps(c.layers), draft_vocab=ref.DRAFT_VOCAB)
    assert cfg.feature_layers == ref.AUX
    draft_ids = torch.randperm(c.vocab, generator=torch.Generator().manual_seed(4))[:ref.DRAFT_VOCAB].sort().values
    m = EagleTrain(cfg, ours.embed, ours.head[draft_ids], seed=5)
    g = torch.Generator().manual_seed(6)
    for name, p in m.p.items():   # norms away from 1, every weight away from its initial value
        p.add_(torch.randn(p.shape, generator=g) * (0.2 if name.endswith("norm") else 0.15))
    with tempfile.TemporaryDirectory() as tmp:
        head_dir = Path(tmp)
        write_eagle3(head_dir, cfg, m.weights() | {"draft_ids": draft_ids}, c.vocab, c.layers)
        ea = cnets.Model(EConfig.from_pretrained(str(head_dir / "config.json")), load_emb=True, path=str(target_dir),
                         total_tokens=ref.CHAIN + 1, depth=ref.CHAIN - 1, top_k=1)
        missing, unexpected = ea.load_state_dict(load_file(str(head_dir / "model.safetensors")), strict=False)
        assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
        ea = ea.float().eval()
        full_ids = torch.tensor([ref.PROMPT + [token0]])
        draft, _, their_logits = ref.authors_chain(ea, aux, full_ids)
        head = load_eagle(head_dir, ours)
    pool = kv.KVPool(head.be, 8, 16, cfg.kv_heads, cfg.head_dim, num_layers=1)
    seq = pool.sequence()
    toks = full_ids[0, 1:]
    b = make_batch(head.be, head.device, pool, [seq], [len(toks)], toks)
    logits, h = head.forward(b, pool.k[0], pool.v[0], toks, aux[0], True)
    seq.commit(len(toks))
    mine, tokens = [logits[-1]], []
    for _ in range(ref.CHAIN - 1):
        t = int(head.draft_ids[int(mine[-1].argmax())])
        tokens.append(t)
        b = make_batch(head.be, head.device, pool, [seq], [1], torch.tensor([t]))
        logits, h = head.forward(b, pool.k[0], pool.v[0], torch.tensor([t]), h[-1:], False)
        seq.commit(1)
        mine.append(logits[-1])
    tokens.append(int(head.draft_ids[int(mine[-1].argmax())]))
    diff = (torch.stack(mine) - their_logits).abs().max().item()
    ok = tokens == draft and diff < 1e-4
    lines = ["# EAGLE-3 heads spec-hal writes, read by SafeAILab's code", "",
             f"Command: `OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/eagle3_written_check.py --src "
             f"/tmp/src_eagle3` ({time.strftime('%Y-%m-%d')}); reference SafeAILab/EAGLE @ {ref.COMMIT}.", "",
             "A random-weight head (`EagleTrain`) for the tiny Llama target of `tests/fixtures/drafters/eagle3`, "
             "written by `write_eagle3` (model.safetensors, fp16), loaded by the authors' `cnets.Model` as "
             "`ea_model.py` loads it (missing only `embed_tokens.weight`, taken from the target) and by "
             "spec-hal's `load_eagle`; both draft a greedy chain of 4 from the same target features.", "",
             "| | tokens | max abs logit difference |", "|---|---|---:|",
             f"| SafeAILab `cnets.Model` | {draft} | |",
             f"| spec-hal `EagleModel` | {tokens} | {diff:.2e} |", "",
             f"Result: {'same chain' if ok else 'DIFFERENT'} (tolerance 1e-4 on fp32 logits).", ""]
    report(args.out, lines, ok)


if __name__ == "__main__":
    main()
