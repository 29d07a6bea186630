"""Generate the DFlash reference fixture by running the authors' own code on tiny random models.

Produces, under ``--out`` (default ``tests/fixtures/drafters/dflash``):

- ``tiny_target/``  config.json + model.safetensors: a random transformers ``Qwen3ForCausalLM`` (6 layers,
  hidden 64, vocab 256, untied lm_head, rope_theta 1e6), fp32;
- ``tiny_dflash/``  config.json + model.safetensors: a random ``DFlashDraftModel`` (2 layers, block 8, mask id
  255, target_layer_ids [0, 2, 4]) with config.json rewritten in the published (transformers 4.57) layout of
  e.g. z-lab/Qwen3-8B-DFlash-b16;
- ``ref_out.pt``    plain tensors/dicts/lists (``torch.load(weights_only=True)``): ``step0`` (one draft block
  right after prefill, with every intermediate), ``loop`` (the authors' ``dflash_generate``, greedy, every draft
  step recorded), ``loop_forced`` (same loop, the target's verify logits rewritten so that exactly
  ``FORCED_SCHEDULE[i]`` drafts are accepted, to exercise accept > 0) and ``meta``.

Reference: z-lab/dflash @ 44947fbf71114e241c96de194f4b382b5dd330d0, ``dflash/model.py``, imported unmodified
from ``--src``. Runtime patches (applied here, never to their file):

1. ``transformers.DynamicCache.crop``: in transformers 5.25 (this repo's) it takes a NEGATIVE count of tokens
   to remove and raises for n > 0; the authors (pinned to 4.57.1) call ``crop(start)`` meaning "keep the first
   ``start`` tokens". The wrapper restores that for n >= 0 (negative n is passed through unchanged).
2. ``dflash.model._cuda_time`` -> ``time.perf_counter``: ``return_stats=True`` calls ``torch.cuda.synchronize``,
   and this runs on CPU. Timing is not part of the output.

Every loop step is checked against a stateless recomputation (fresh caches) on the verified prefix.

Command used (CPU, a few seconds)::

    mkdir /tmp/src_dflash && git -C /work/.mirror/z-lab+dflash/repo archive \\
        44947fbf71114e241c96de194f4b382b5dd330d0 | tar -x -C /tmp/src_dflash
    OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/dflash_reference.py --src /tmp/src_dflash
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle_compat import patch_dynamic_cache_crop  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
COMMIT = "44947fbf71114e241c96de194f4b382b5dd330d0"
SEED = 1234
ROPE_THETA = 1_000_000.0
TARGET_KW = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                 max_position_embeddings=512, tie_word_embeddings=False)
BLOCK_SIZE = 8
MASK_TOKEN_ID = 255
TARGET_LAYER_IDS = [0, 2, 4]   # deliberately != build_target_layer_ids(6, 2) == [1, 3]; includes layer 0
DRAFT_KW = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                max_position_embeddings=512, tie_word_embeddings=False)
PROMPT = [3, 17, 42, 99, 5, 123, 7, 200, 31, 64, 12, 250]
MAX_NEW = 32
FORCED_SCHEDULE = [3, 0, 7, 2, 5, 1, 6, 4]  # acceptance lengths forced in the "loop_forced" run


def load_reference(src: Path):
    """The authors' ``dflash.model`` from a checkout at ``src``, with the two runtime patches."""
    sys.path.insert(0, str(src))
    import dflash.model as ref
    patch_dynamic_cache_crop()
    ref._cuda_time = time.perf_counter   # runtime patch 2: no torch.cuda.synchronize on CPU
    return ref


def randomize_(module: nn.Module, seed: int):
    """Larger-than-default random weights so logits have real margins; norm weights 1+0.1*N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def update_config(folder: Path, updates: dict, drop=()):
    path = folder / "config.json"
    c = json.loads(path.read_text())
    for k in drop:
        c.pop(k, None)
    c.update(updates)
    path.write_text(json.dumps(c, indent=2, sort_keys=True))


def build_and_save(ref, out: Path, attn: str):
    """Save both tiny models, then reload them from disk: the oracle runs on exactly what was saved."""
    torch.manual_seed(SEED)
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    target = Qwen3ForCausalLM(Qwen3Config(**TARGET_KW, rope_parameters=rope))
    randomize_(target, SEED)
    tdir = out / "tiny_target"
    target.save_pretrained(tdir, safe_serialization=True)
    # also write the legacy (transformers 4.x / published Qwen3) rope keys next to rope_parameters
    update_config(tdir, {"rope_theta": ROPE_THETA, "rope_scaling": None})

    dflash_config = {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": TARGET_LAYER_IDS}
    dcfg = Qwen3Config(**DRAFT_KW, rope_parameters=rope, block_size=BLOCK_SIZE,
                       num_target_layers=TARGET_KW["num_hidden_layers"], dflash_config=dflash_config)
    draft = ref.DFlashDraftModel(dcfg)
    randomize_(draft, SEED + 1)
    ddir = out / "tiny_dflash"
    draft.save_pretrained(ddir, safe_serialization=True)
    update_config(ddir, drop=["rope_parameters"], updates={   # the published (transformers 4.57.x) layout
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "block_size": BLOCK_SIZE, "num_target_layers": TARGET_KW["num_hidden_layers"],
        "dflash_config": dflash_config, "rope_theta": ROPE_THETA, "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * DRAFT_KW["num_hidden_layers"]})

    target = Qwen3ForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation=attn).eval()
    draft = ref.DFlashDraftModel.from_pretrained(ddir, dtype=torch.float32, attn_implementation=attn).eval()
    assert draft.target_layer_ids == TARGET_LAYER_IDS and draft.block_size == BLOCK_SIZE
    assert draft.mask_token_id == MASK_TOKEN_ID
    assert draft.config.rope_parameters["rope_theta"] == ROPE_THETA, draft.config.rope_parameters
    return target, draft


@torch.inference_mode()
def stateless_draft(ref, draft, target, seq_ids, P):
    """Draft logits for the block starting at position P, from scratch (fresh caches).

    seq_ids[0, :P+1] is the verified prefix; seq_ids[0, P] is block slot 0 (the last verified / bonus token).
    Context = target features of tokens 0..P-1 (one causal target forward over seq_ids[:, :P]).
    """
    out = target(seq_ids[:, :P], output_hidden_states=True, use_cache=False)
    target_hidden = ref.extract_context_feature(out.hidden_states, draft.target_layer_ids)      # (1, P, k*H)
    block = torch.full((1, BLOCK_SIZE), draft.mask_token_id, dtype=torch.long)
    block[:, 0] = seq_ids[:, P]
    noise = target.model.embed_tokens(block)
    pos = torch.arange(P + BLOCK_SIZE).unsqueeze(0)
    layer_outs = []
    hooks = [l.register_forward_hook(lambda m, a, o: layer_outs.append(o.detach().clone())) for l in draft.layers]
    h = draft(target_hidden=target_hidden, noise_embedding=noise, position_ids=pos,
              past_key_values=DynamicCache(), use_cache=True, is_causal=False)
    for hk in hooks:
        hk.remove()
    logits = target.lm_head(h[:, 1 - BLOCK_SIZE:, :])
    return dict(P=P, target_hidden=target_hidden, ctx_proj=draft.hidden_norm(draft.fc(target_hidden)),
                block_ids=block, position_ids=pos, layer_outputs=layer_outs, draft_hidden=h,
                draft_logits=logits, draft_tokens=logits.argmax(-1))


class ForcedAcceptTarget(nn.Module):
    """Wraps the real target; on verify calls rewrites logits so that exactly schedule[i] drafts are accepted.
    Hidden states / KV cache are the real target's, so draft inputs stay real. Only used to exercise accept>0."""

    def __init__(self, target, schedule, block_size):
        super().__init__()
        self.t, self.schedule, self.bs, self.calls = target, list(schedule), block_size, 0
        self.model, self.lm_head = target.model, target.lm_head

    @property
    def device(self):
        return self.t.device

    def forward(self, input_ids, **kw):
        out = self.t(input_ids, **kw)
        self.calls += 1
        if self.calls == 1:  # prefill
            return out
        k = self.schedule[(self.calls - 2) % len(self.schedule)]
        lg = out.logits.clone()
        for j in range(k):
            lg[0, j, input_ids[0, j + 1]] = lg[0, j].max() + 10.0
        if k < self.bs - 1 and lg[0, k].argmax() == input_ids[0, k + 1]:
            lg[0, k, input_ids[0, k + 1]] = lg[0, k].min() - 10.0
        out.logits = lg
        return out


class StepRecorder:
    """Forward hooks recording every draft step of ``dflash_generate``: its block ids and draft outputs."""

    def __init__(self, draft, target):
        self.steps, self.last_ids, self.lm_head = [], None, target.lm_head
        self.hooks = [target.model.embed_tokens.register_forward_hook(self.on_embed),
                      draft.register_forward_hook(self.on_draft, with_kwargs=True)]

    def on_embed(self, module, args, out):
        self.last_ids = args[0].detach().clone()

    def on_draft(self, module, args, kwargs, out):
        pos = kwargs["position_ids"]
        logits = self.lm_head(out[:, 1 - BLOCK_SIZE:, :])
        self.steps.append(dict(start=int(pos[0, -BLOCK_SIZE]), cache_len_before=int(pos[0, 0]),
                               ctx_len=int(kwargs["target_hidden"].shape[1]), position_ids=pos.clone(),
                               block_ids=self.last_ids.clone(), draft_hidden=out.detach().clone(),
                               draft_logits=logits.detach().clone(), draft_tokens=logits.argmax(-1)))

    def remove(self):
        for h in self.hooks:
            h.remove()


def run_loop(ref, draft, target_like, real_target, prompt):
    rec = StepRecorder(draft, real_target)
    res = ref.dflash_generate(draft, target=target_like, input_ids=prompt, max_new_tokens=MAX_NEW,
                              stop_token_ids=None, temperature=0.0, return_stats=True)
    rec.remove()
    for s, a in zip(rec.steps, res.acceptance_lengths):
        s["accepted_drafts"] = a - 1
    return dict(output_ids=res.output_ids, acceptance_lengths=res.acceptance_lengths, steps=rec.steps)


def check_stateless(ref, draft, target, loop):
    """Each loop step's draft logits must equal the from-scratch computation on the final verified prefix."""
    worst = 0.0
    for s in loop["steps"]:
        st = stateless_draft(ref, draft, target, loop["output_ids"], s["start"])
        assert torch.equal(st["block_ids"], s["block_ids"]), (st["block_ids"], s["block_ids"])
        worst = max(worst, (st["draft_logits"] - s["draft_logits"]).abs().max().item())
        assert torch.equal(st["draft_tokens"], s["draft_tokens"]), s["start"]
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="checkout of z-lab/dflash (contains dflash/)")
    ap.add_argument("--out", type=Path, default=REPO / "tests/fixtures/drafters/dflash")
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    ref = load_reference(args.src)
    args.out.mkdir(parents=True, exist_ok=True)
    target, draft = build_and_save(ref, args.out, args.attn)
    prompt = torch.tensor([PROMPT], dtype=torch.long)

    with torch.inference_mode():
        pre = target(prompt, output_hidden_states=True, use_cache=False)
    first_tok = pre.logits[:, -1].argmax(-1)
    seq0 = torch.cat([prompt, first_tok[:, None]], dim=1)
    step0 = stateless_draft(ref, draft, target, seq0, prompt.shape[1])
    step0["target_first_token"] = int(first_tok)
    step0["target_hidden_states_all"] = [h.clone() for h in pre.hidden_states]  # [0]=embeddings, [i+1]=layer i

    loop = run_loop(ref, draft, target, target, prompt)
    d1 = check_stateless(ref, draft, target, loop)
    loop_forced = run_loop(ref, draft, ForcedAcceptTarget(target, FORCED_SCHEDULE, BLOCK_SIZE), target, prompt)
    d2 = check_stateless(ref, draft, target, loop_forced)
    assert torch.allclose(loop["steps"][0]["draft_logits"], step0["draft_logits"], atol=1e-4)

    meta = dict(commit=COMMIT, seed=SEED, attn=args.attn, dtype="float32", block_size=BLOCK_SIZE,
                mask_token_id=MASK_TOKEN_ID, target_layer_ids=TARGET_LAYER_IDS, rope_theta=ROPE_THETA,
                target_kw=TARGET_KW, draft_kw=DRAFT_KW, max_new_tokens=MAX_NEW, forced_schedule=FORCED_SCHEDULE,
                stateless_vs_loop_max_abs_diff=max(d1, d2))
    torch.save(dict(meta=meta, prompt_ids=prompt, step0=step0, loop=loop, loop_forced=loop_forced),
               args.out / "ref_out.pt")
    (args.out / "tiny_target" / "generation_config.json").unlink(missing_ok=True)   # defaults only; unused

    print(f"[dflash ref @ {COMMIT[:12]}] attn={args.attn} wrote {args.out}; step0 draft tokens "
          f"{step0['draft_tokens'].tolist()}; acceptance {loop['acceptance_lengths']}, forced "
          f"{loop_forced['acceptance_lengths']}; stateless vs incremental max |dlogit| {max(d1, d2):.3g}")


if __name__ == "__main__":
    main()
