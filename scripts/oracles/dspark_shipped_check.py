"""Does DeepSpec's own code, given the shipped SmolLM2-135M DSpark drafter as ``spec-hal model
export-drafter dspark`` writes it, propose the block spec-hal's shipped drafter proposes on the
real target?

The export (DeepSpec's ``Qwen3DSparkModel`` layout, with the target's embeddings and lm_head) is
loaded by DeepSpec's ``Qwen3DSparkModel.from_pretrained`` and proposes one greedy block right
after prefill as its evaluator does (`dspark_reference.single_block`), fed the hidden states of
the bundled GGUF as spec-hal's runner computes them (the float32 plan: DeepSpec's code asks a
transformers model for them; here that model is a stand-in over spec-hal's forward, so both sides
read the very same features). The drafter's token map is applied on DeepSpec's side as SGLang's
``--speculative-token-map`` applies it (logits outside the map -inf; DeepSpec's code has no token
map). spec-hal's shipped folder (without the copies) proposes from the same prompts. Writes
``benchmarks/results/dspark-shipped-check.md``.

Reference: deepseek-ai/DeepSpec @ afdfa7c9382a3341a3e6f17756dd816da79f132c (as `dspark_reference.py`)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dspark_shipped_check.py --src /tmp/src_dspark
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

__import__("sys").path.insert(0, str(Path(__file__).parent))

import dspark_reference as ref  # noqa: E402
from written_common import block_proposal, parse, report  # noqa: E402

PROMPTS = ["Tell me about the history of the bicycle.", "What should I pack for a weekend of hiking?",
           "Explain how a refrigerator keeps food cold."]


class Target:
    """What `dspark_reference.single_block` asks of a transformers target, answered by spec-hal's
    runner: the last row's logits and the hidden states ``hidden_states[id + 1]`` of the taps."""

    def __init__(self, model, taps):
        self.model, self.taps = model, tuple(taps)

    def __call__(self, input_ids, **_):
        from hal import kv
        from hal.engine.forward import forward_tokens
        c, n = self.model.cfg, input_ids.shape[1]
        pool = kv.KVPool(self.model.be, 64, 16, c.kv_heads, c.head_dim, num_layers=self.model.num_layers)
        rows = torch.arange(n)
        logits, feats = forward_tokens(self.model, pool, [pool.sequence()], [n], input_ids[0], rows=rows[-1:],
                                       hidden_rows=rows, feature_layers=self.taps)[:2]
        hidden = [None] * (c.layers + 1)
        for j, tap in enumerate(self.taps):
            hidden[tap] = feats[None, :, j * c.hidden:(j + 1) * c.hidden].float()
        return SimpleNamespace(logits=logits[None].float(), hidden_states=tuple(hidden))


def main():
    args = parse(__doc__, "dspark-shipped-check", "checkout of deepseek-ai/DeepSpec (contains deepspec/)")
    r = ref.load_reference(args.src)
    import hal
    from hal.drafters.dspark import DSparkDrafter
    from hal.models.block_layouts import load_block, read_layout, token_map
    from hal.models.dspark import shipped_block
    from hal.models.export import export_drafter
    from hal.models.fetch import load_model
    from hal.models.tokenizer import chatml

    be = hal.get_backend("cpu")
    target, tok = load_model("smollm2-135m", be, "float32")
    folder = shipped_block("smollm2-135m")
    layout = read_layout(folder)
    hot = token_map(folder, target.cfg.vocab)
    model = load_block(folder, target)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        out = export_drafter("dspark", "smollm2-135m", Path(tmp) / "export", be)
        draft = r.Model.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
        outside = torch.ones(target.cfg.vocab, dtype=torch.bool)
        outside[hot] = False
        logits_of = draft.compute_logits
        draft.compute_logits = lambda h: logits_of(h).masked_fill(outside, float("-inf"))   # the token map
        stand_in = Target(target, layout.cfg.taps)
        for text in PROMPTS:
            prompt = torch.tensor([tok.encode(chatml(text)).ids])
            with torch.no_grad():
                theirs = ref.single_block(r, stand_in, draft, prompt, mask_id=layout.mask_token,
                                          block=layout.cfg.block)
            n, anchor = prompt.shape[1], int(theirs["anchor_token"])
            drafter = DSparkDrafter(model)   # a new request's drafter state
            p = block_proposal(drafter, target, prompt[0].tolist() + [anchor], n, layout.cfg.taps, layout.cfg.block)
            mine, want = p.draft_token_ids.tolist(), theirs["draft_tokens"][0].tolist()
            dconf = (torch.tensor(drafter.confidences[0]) - theirs["confidence"][0]).abs().max().item()
            ok &= mine == want and dconf < 1e-4
            rows.append(f"| {text} | {want} | {mine} | {dconf:.2e} |")
    lines = ["# The shipped DSpark drafter, exported, read by DeepSpec's code", "",
             f"Command: `OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dspark_shipped_check.py --src "
             f"/tmp/src_dspark` ({time.strftime('%Y-%m-%d')}); reference deepseek-ai/DeepSpec @ {ref.COMMIT}.", "",
             "`spec-hal model export-drafter dspark` (the shipped folder with the target's embeddings and lm_head "
             "written back) loaded by DeepSpec's `Qwen3DSparkModel.from_pretrained`, the shipped folder by "
             "spec-hal's `load_block`; each proposes one greedy block of 7 after the same chat prompt, from the "
             "bundled GGUF's hidden states (spec-hal's float32 plan); the token map applied on DeepSpec's side as "
             "SGLang applies it.", "",
             "| prompt | DeepSpec `Qwen3DSparkModel` | spec-hal `DSparkModel` | max abs confidence difference |",
             "|---|---|---|---:|", *rows, "",
             f"Result: {'same blocks' if ok else 'DIFFERENT'} (confidences within 1e-4).", ""]
    report(args.out, lines, ok)


if __name__ == "__main__":
    main()
