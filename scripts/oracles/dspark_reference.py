"""Generate the DSpark reference fixture by running the authors' own code on tiny random models.

Produces, under ``--out`` (default ``tests/fixtures/drafters/dspark``):

- ``tiny_target/``  config.json + model.safetensors: a random transformers ``Qwen3ForCausalLM`` (4 layers,
  hidden 64, vocab 256, untied lm_head, rope_theta 1e4), fp32;
- ``tiny_dspark/``  config.json + model.safetensors: a random ``Qwen3DSparkModel`` in the published DeepSpec
  layout (``save_pretrained`` of the draft: 2 layers, block 7, mask id 250, target_layer_ids [0, 2], vanilla
  Markov head of rank 8, confidence head with Markov input; embed_tokens / lm_head copied from the target);
- ``ref_out.pt``    plain tensors/dicts/lists (``torch.load(weights_only=True)``): one proposal right after
  prefill with every intermediate (context features, fused context, block hidden, base / Markov-biased
  logits, confidence logits, survival, proposal lengths at thresholds 0 and 0.5), then the authors' full
  speculative loop (``Qwen3DSparkEvaluator.generate_one_sample``), greedy (``greedy_loop``) and sampled at
  temperature 1 with ``torch.manual_seed(0)`` (``sampled_loop``), every round's draft outputs recorded.

Reference: deepseek-ai/DeepSpec @ afdfa7c9382a3341a3e6f17756dd816da79f132c, package ``deepspec`` imported
unmodified from ``--src``. Runtime patch (applied here, never to their files):

1. ``transformers.DynamicCache.crop``: in transformers 5.25 (this repo's) it takes a NEGATIVE count of tokens
   to remove and raises for n > 0; DeepSpec pins transformers 5.10.2 and calls ``crop(start)`` meaning "keep
   the first ``start`` tokens" (eval/dspark/draft_ops.py:44, eval/base_evaluator.py:418,425). The wrapper
   restores that for n >= 0 (negative n is passed through unchanged).

Command used (CPU, a few seconds; only ``deepspec/`` is archived since the mirror lacks some large blobs)::

    mkdir /tmp/src_dspark && git -C /work/.mirror/deepseek-ai+DeepSpec/repo archive \\
        afdfa7c9382a3341a3e6f17756dd816da79f132c deepspec | tar -x -C /tmp/src_dspark
    OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dspark_reference.py --src /tmp/src_dspark
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle_compat import patch_dynamic_cache_crop  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
COMMIT = "afdfa7c9382a3341a3e6f17756dd816da79f132c"
VOCAB = 256
HIDDEN = 64
BLOCK = 7
MASK_ID = 250          # like Qwen's 151669: a real id inside the vocab
TARGET_LAYERS = 4
TARGET_LAYER_IDS = [0, 2]   # must not contain the last target layer (3)
DRAFT_LAYERS = 2
MARKOV_RANK = 8
MAX_NEW = 24


def load_reference(src: Path) -> SimpleNamespace:
    """The authors' DSpark classes and functions from a checkout at ``src``, with the runtime patch."""
    sys.path.insert(0, str(src))
    from deepspec.eval.dspark import draft_ops
    from deepspec.eval.dspark.evaluator import Qwen3DSparkEvaluator
    from deepspec.modeling.dspark.common import extract_context_feature
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config
    patch_dynamic_cache_crop()
    return SimpleNamespace(draft_ops=draft_ops, Evaluator=Qwen3DSparkEvaluator, Model=Qwen3DSparkModel,
                           build_draft_config=build_draft_config, extract_context_feature=extract_context_feature)


class ModelArgs(dict):
    """build_draft_config uses both `"k" in args` and `args.k`."""
    __getattr__ = dict.__getitem__


def make_target():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      tie_word_embeddings=False, initializer_range=0.05,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen3ForCausalLM(cfg).float().eval()


def randomize_draft(draft, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith("embed_tokens") or name.startswith("lm_head"):
                continue  # copied (frozen) from the target, as in training
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "markov_head.markov_w1.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif name == "markov_head.markov_w2.weight":
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # confidence_head.proj.bias
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def make_draft(ref, target):
    args = ModelArgs(block_size=BLOCK, num_draft_layers=DRAFT_LAYERS, target_layer_ids=TARGET_LAYER_IDS,
                     mask_token_id=MASK_ID, num_anchors=4, markov_rank=MARKOV_RANK, markov_head_type="vanilla",
                     confidence_head_alpha=1.0, confidence_head_with_markov=True)
    draft = ref.Model(ref.build_draft_config(target.config, args)).float()
    draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings(), freeze=True)
    randomize_draft(draft)
    return draft.eval()


def check_hidden_state_convention(target, prompt):
    """hidden_states[i+1] == raw output of decoder layer i (i < last); returns whether the last one is normed."""
    caught = {}
    hooks = [layer.register_forward_hook(
        lambda m, i, o, idx=idx: caught.__setitem__(idx, o[0] if isinstance(o, tuple) else o))
        for idx, layer in enumerate(target.model.layers)]
    with torch.no_grad():
        hs = target(input_ids=prompt, output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    assert len(hs) == TARGET_LAYERS + 1, len(hs)
    for i in range(TARGET_LAYERS - 1):
        assert torch.equal(hs[i + 1], caught[i]), i
    return torch.allclose(hs[-1], target.model.norm(caught[TARGET_LAYERS - 1]))


@torch.inference_mode()
def single_block(ref, target, draft, prompt, mask_id=MASK_ID, block=BLOCK):
    """One DSpark proposal right after prefill, exactly as Qwen3DSparkEvaluator does."""
    ops, n, BLOCK, MASK_ID = ref.draft_ops, prompt.shape[1], block, mask_id  # noqa: N806
    position_ids = torch.arange(n + 64).unsqueeze(0)
    out = target(input_ids=prompt, position_ids=position_ids[:, :n], past_key_values=DynamicCache(),
                 use_cache=True, output_hidden_states=True, logits_to_keep=1)
    anchor = out.logits[:, -1].argmax(-1)  # greedy first token = anchor at position n
    ctx = ref.extract_context_feature(out.hidden_states, draft.target_layer_ids)
    draft_input_ids = torch.full((1, BLOCK), MASK_ID, dtype=torch.long)
    draft_input_ids[:, 0] = anchor
    cache = DynamicCache()
    block_hidden = ops.forward_dspark_draft_block(
        draft, draft_input_ids=draft_input_ids, position_ids=position_ids, past_key_values_draft=cache,
        target_hidden_states=ctx, start=n, block_size=BLOCK)
    hidden = block_hidden[:, :BLOCK]
    base_logits = draft.compute_logits(hidden)
    tokens, logits = draft.sample_draft_tokens(base_logits, first_prev_token_ids=draft_input_ids[:, 0],
                                               temperature=0.0, hidden_states=hidden)
    conf_logits = ops._predict_confidence_logits(draft, proposal_hidden_states=hidden,
                                                 draft_input_ids=draft_input_ids, sampled_tokens=tokens,
                                                 block_size=BLOCK)
    conf = conf_logits.sigmoid()
    proposals = {thr: ops.build_dspark_proposal(draft, draft_input_ids=draft_input_ids, block_hidden=block_hidden,
                                                block_size=BLOCK, temperature=0.0, confidence_threshold=thr)
                 for thr in (0.0, 0.5)}
    assert torch.equal(proposals[0.0].verify_input_ids[:, 1:], tokens)
    assert torch.equal(tokens, logits.argmax(-1))
    return dict(
        prompt_ids=prompt,
        anchor_token=anchor,
        anchor_position=n,
        context_features=ctx,              # [1, n, len(ids)*H] concat(hidden_states[id+1])
        fused_context=draft.hidden_norm(draft.fc(ctx)),   # what k_proj/v_proj see
        draft_input_ids=draft_input_ids,   # [anchor, MASK x 6]
        draft_position_ids=position_ids[:, : n + BLOCK],  # ctx 0..n-1 then block n..n+6
        draft_cache_len_after=cache.get_seq_length(),     # == n (block K/V cropped away)
        block_hidden=block_hidden,         # final-normed draft hidden [1, 7, H]
        base_logits=base_logits,           # lm_head(block_hidden), before Markov
        draft_logits=logits,               # after Markov bias, per slot (slot k -> pos n+k+1)
        draft_tokens=tokens,               # greedy, sampled left-to-right with Markov
        markov_bias=logits - base_logits,
        confidence_logits=conf_logits,     # [1, 7] raw
        confidence=conf,                   # sigmoid
        survival=conf.double().cumprod(-1).float(),       # cumprod of sigmoid
        proposal_len_thr0=proposals[0.0].draft_token_count,
        proposal_len_thr05=proposals[0.5].draft_token_count,
    )


class RoundRecorder:
    """Instance-level wrappers around the evaluator's ``_propose`` and the draft's sampling and confidence
    methods, recording each round's start, anchor, draft tokens / logits and confidence logits."""

    def __init__(self, ev, draft):
        self.rounds, self.ev, self.draft = [], ev, draft
        self.orig_propose, self.orig_sample = ev._propose, draft.sample_draft_tokens
        self.orig_conf = draft.predict_confidence_step
        ev._propose, draft.sample_draft_tokens = self.propose, self.sample
        draft.predict_confidence_step = self.conf

    def propose(self, **kw):
        self.rounds.append(dict(start=int(kw["start"]), anchor=int(kw["output_ids"][0, kw["start"]])))
        return self.orig_propose(**kw)

    def sample(self, base_logits, **kw):
        t, l = self.orig_sample(base_logits, **kw)
        self.rounds[-1].update(draft_tokens=t.clone(), draft_logits=l.clone())
        return t, l

    def conf(self, hidden, prev_token_ids=None):
        c = self.orig_conf(hidden, prev_token_ids=prev_token_ids)
        self.rounds[-1].update(confidence_logits=c.clone())
        return c

    def remove(self):
        del self.draft.sample_draft_tokens, self.draft.predict_confidence_step


def run_loop(ref, target, draft, prompt, temperature, seed=0):
    """The authors' full speculative loop, with per-round draft outputs recorded."""
    ev = ref.Evaluator.__new__(ref.Evaluator)
    ev.draft_model, ev.target_model, ev.confidence_head_recorder = draft, target, None
    ev.args = SimpleNamespace(temperature=temperature, confidence_threshold=0.0, max_new_tokens=MAX_NEW)
    rec = RoundRecorder(ev, draft)
    torch.manual_seed(seed)
    try:
        res = ev.generate_one_sample(input_ids=prompt, stop_token_ids=None)
    finally:
        rec.remove()
    for r, acc in zip(rec.rounds, res.accepted_draft_lengths):
        r["accepted"] = acc
    # clone: output_ids is a view into a torch.empty buffer whose unused tail would be saved as run-to-run noise
    return dict(output_ids=res.output_ids.clone(), acceptance_lengths=res.acceptance_lengths,
                accepted_draft_lengths=res.accepted_draft_lengths, rounds=rec.rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="checkout of deepseek-ai/DeepSpec (contains deepspec/)")
    ap.add_argument("--out", type=Path, default=REPO / "tests/fixtures/drafters/dspark")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = load_reference(args.src)
    target_dir, draft_dir = args.out / "tiny_target", args.out / "tiny_dspark"
    target = make_target()
    draft = make_draft(ref, target)
    target.save_pretrained(target_dir)
    draft.save_pretrained(draft_dir)

    # Reload both the way Qwen3DSparkEvaluator.build_models does (fp32 here).
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    draft = ref.Model.from_pretrained(draft_dir, dtype=torch.float32, attn_implementation="sdpa").eval()

    prompt = torch.randint(0, 240, (1, 12), generator=torch.Generator().manual_seed(1234))
    meta = dict(deepspec_commit=COMMIT, block_size=BLOCK, mask_token_id=MASK_ID, target_layer_ids=TARGET_LAYER_IDS,
                markov_rank=MARKOV_RANK, dtype="float32", attn_implementation="sdpa",
                last_hidden_state_is_normed=check_hidden_state_convention(target, prompt))
    out = dict(meta=meta, **single_block(ref, target, draft, prompt))
    out["greedy_loop"] = run_loop(ref, target, draft, prompt, temperature=0.0)
    out["sampled_loop"] = run_loop(ref, target, draft, prompt, temperature=1.0)
    torch.save(out, args.out / "ref_out.pt")
    (target_dir / "generation_config.json").unlink(missing_ok=True)   # defaults only; unused

    print(f"[dspark ref @ {COMMIT[:12]}] wrote {args.out}; anchor {int(out['anchor_token'])}, draft tokens "
          f"{out['draft_tokens'].tolist()}, confidence {[round(x, 4) for x in out['confidence'][0].tolist()]}")
    print("proposal len thr0/thr0.5:", out["proposal_len_thr0"], out["proposal_len_thr05"],
          "accepted per round, greedy:", out["greedy_loop"]["accepted_draft_lengths"],
          "sampled:", out["sampled_loop"]["accepted_draft_lengths"])


if __name__ == "__main__":
    main()
