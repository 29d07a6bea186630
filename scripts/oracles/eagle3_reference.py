"""Generate the EAGLE-3 reference fixture by running the authors' own head class on tiny random models.

Produces, under ``--out`` (default ``tests/fixtures/drafters/eagle3``):

- ``tiny_target/``  a random transformers ``LlamaForCausalLM`` (8 layers, hidden 64, vocab 256, rope_theta 5e5,
  Llama-3 style), fp32, saved SHARDED (4 safetensors + model.safetensors.index.json) so the authors' unmodified
  ``load_emb=True`` path can read the target's embed_tokens through the index;
- ``tiny_head/``    config.json + pytorch_model.bin in the ORIGINAL SafeAILab layout (the published
  yuhuili/EAGLE3-LLaMA3.1-Instruct-8B keys scaled down, no rope_theta on purpose so the head's RoPE base is
  10000; fp16; ``midlayer.*`` names; draft vocab 128 with d2t/t2d; no embed_tokens);
- ``ref_out.pt``    plain tensors/dicts/lists (``torch.load(weights_only=True)``): the target's aux features
  (residual stream ENTERING layers 2, L//2, L-3, as eagle/model/modeling_llama_kv.py:1137-1139 collects them),
  fc output, the target's next token and greedy continuation, and the head's greedy draft chain (4 tokens:
  target-vocab ids, draft-vocab ids, fp32 draft logits, logits scattered into the full vocab, top-1 margins).

The chain is computed with the authors' ``Model`` forward and cross-checked against their ``topK_genrate``
(top_k=1, a chain) and against an independent re-derivation from the saved files (max |diff| < 1e-4).

Reference: SafeAILab/EAGLE @ cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b, ``eagle/model/cnets.py`` and
``eagle/model/configs.py`` imported unmodified from ``--src``. Runtime patch (applied here, never to their file):

1. ``cnets.LlamaAttention._init_rope``: transformers >= 5 makes ``config.rope_scaling`` an alias of
   ``rope_parameters`` (``{'rope_type': 'default', 'rope_theta': X}``) even for a config.json without rope keys,
   so their ``rope_scaling["type"]`` raises KeyError. The wrapper treats a 'default' entry as "no scaling" with
   base = its rope_theta (10000 when config.json has none), which is the transformers-4 behaviour; any other
   value goes to their method unchanged.

Command used (CPU, a few seconds; only ``eagle/model`` is archived since the mirror lacks some large blobs)::

    mkdir /tmp/src_eagle3 && git -C /work/.mirror/SafeAILab+EAGLE/repo archive \\
        cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b eagle/model | tar -x -C /tmp/src_eagle3
    OMP_NUM_THREADS=1 .venv/bin/python scripts/oracles/eagle3_reference.py --src /tmp/src_eagle3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[2]
COMMIT = "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b"
H, HEADS, KV_HEADS, FFN, VOCAB, DRAFT_VOCAB, LAYERS = 64, 4, 2, 128, 256, 128, 8
TARGET_ROPE_THETA = 500000.0   # Llama-3 style target; the head config (like yuhuili's) has NO rope_theta -> 10000
EPS = 1e-5
PROMPT = [1] + torch.randint(3, 256, (47,), generator=torch.Generator().manual_seed(3)).tolist()  # 48 tokens
CHAIN = 4                      # greedy draft chain length (1 prefill step + 3 chained steps)
AUX = tuple(sorted({2, LAYERS // 2, LAYERS - 3}))   # EAGLE-3 taps (modeling_llama_kv.py:1138), in that order
HEAD_CONFIG = {   # the published yuhuili/EAGLE3-LLaMA3.1-Instruct-8B keys, scaled down (no rope_theta on purpose)
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": H, "initializer_range": 0.02, "intermediate_size": FFN, "max_position_embeddings": 2048,
    "model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1,
    "pad_token_id": 0, "rms_norm_eps": EPS, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB}


def load_reference(src: Path):
    """The authors' ``cnets`` module and ``EConfig`` from a checkout at ``src``, with the runtime patch."""
    sys.path.insert(0, str(src))
    from eagle.model import cnets
    from eagle.model.configs import EConfig
    original = cnets.LlamaAttention._init_rope

    def _init_rope(self):
        rs = self.config.rope_scaling
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "default":
            self.rotary_emb = cnets.LlamaRotaryEmbedding(self.head_dim, base=rs.get("rope_theta", 10000),
                                                         max_position_embeddings=self.max_position_embeddings)
        else:
            original(self)

    cnets.LlamaAttention._init_rope = _init_rope
    return cnets, EConfig


def build_target(target_dir: Path):
    torch.manual_seed(0)
    tcfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                       rms_norm_eps=EPS, initializer_range=0.1, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       rope_parameters={"rope_type": "default", "rope_theta": TARGET_ROPE_THETA})
    target = LlamaForCausalLM(tcfg).float().eval()
    target.save_pretrained(target_dir, max_shard_size="400KB")   # sharded: the authors' load_emb reads the index
    return target


def target_features(target, ids):
    """Aux features [1, T, 3H] from forward pre-hooks, whether they equal HF hidden_states[i], next token, greedy."""
    assert len(AUX) == 3, "tiny target needs >= 7 layers for 3 distinct taps"
    captured = {}

    def hook(i):
        return lambda mod, args, kwargs: captured.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone())

    hooks = [target.model.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in AUX]
    out = target(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    aux = torch.cat([captured[i] for i in AUX], -1)
    hf_equal = all(torch.equal(captured[i], out.hidden_states[i]) for i in AUX)
    token0 = int(out.logits[0, -1].argmax())
    greedy = target.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    return aux, hf_equal, token0, greedy


def write_head(cnets, EConfig, head_dir: Path):
    """Random head weights in the original layout (fp16 .bin, norms != 1, d2t/t2d like traineagle3 builds them)."""
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(HEAD_CONFIG, indent=2) + "\n")
    torch.manual_seed(1)
    proto = cnets.Model(EConfig.from_pretrained(str(head_dir / "config.json")), load_emb=False)
    sd = {k: v for k, v in proto.state_dict().items() if k != "embed_tokens.weight"}
    for k in sd:   # norms != 1 so a loader that swaps input_layernorm / hidden_norm / norm is caught
        if k.endswith("norm.weight"):
            sd[k] = 1.0 + 0.2 * torch.randn_like(sd[k])
    used = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:DRAFT_VOCAB].sort().values
    used[0] = 0   # keep token 0 mapped (harmless); traineagle3/cnets.py:671-674 builds d2t/t2d exactly like this
    used = used.unique()
    assert used.numel() == DRAFT_VOCAB
    sd["d2t"] = used - torch.arange(DRAFT_VOCAB)                          # target_id = draft_id + d2t[draft_id]
    sd["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    sd["t2d"][used] = True
    sd = {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}   # published heads: fp16 .bin
    torch.save(sd, head_dir / "pytorch_model.bin")


def load_head(cnets, EConfig, head_dir: Path, target_dir: Path, target):
    """The head as eagle/model/ea_model.py loads it: embeddings from the target's index, then strict=False."""
    cfg = EConfig.from_pretrained(str(head_dir / "config.json"))
    ea = cnets.Model(cfg, load_emb=True, path=str(target_dir), total_tokens=CHAIN + 1, depth=CHAIN - 1, top_k=1)
    missing, unexpected = ea.load_state_dict(torch.load(head_dir / "pytorch_model.bin"), strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    assert torch.equal(ea.embed_tokens.weight, target.model.embed_tokens.weight)   # came from the target
    return ea.float().eval()


def authors_chain(ea, aux, full_ids):
    """Greedy chain with the authors' forward: prefill pairs (aux_t, x_{t+1}) at t = 0..T-1, then CHAIN-1 steps
    feeding back the pre-norm output with the drafted token (mapped to the target vocab) at positions T, T+1, ..."""
    o, kv = ea(aux, input_ids=full_ids[:, 1:], use_cache=True)
    x, pos = o[:, -1:], len(PROMPT)
    draft, draft_vocab_ids, logits_all = [], [], []
    for step in range(CHAIN):
        lg = ea.lm_head(ea.norm(x[:, -1]))[0].float()                      # [Vd]
        d = int(lg.argmax())
        tok = d + int(ea.d2t[d])
        logits_all.append(lg)
        draft_vocab_ids.append(d)
        draft.append(tok)
        if step + 1 < CHAIN:
            x, kv = ea(x, input_ids=torch.tensor([[tok]]), past_key_values=kv,
                       position_ids=torch.tensor([pos]), use_cache=True)
            pos += 1
    return draft, draft_vocab_ids, torch.stack(logits_all)


def rms(x, w):
    x32 = x.float()
    return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, p, base):   # x [n, heads, D], non-interleaved (rotate_half) like HF Llama
    D = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    f = p.float()[:, None] * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def head_step(W, E, base, kv, h, toks, p):
    """One head forward from the saved weights. h [n, H] (fc output or previous pre-norm output), toks [n] target
    ids, p [n] positions; kv = ([K...], [V...]) grows in place."""
    m, D = "midlayer.", H // HEADS
    x = torch.cat([rms(E[toks], W[m + "input_layernorm.weight"]), rms(h, W[m + "hidden_norm.weight"])], -1)
    q = rope((x @ W[m + "self_attn.q_proj.weight"].T).view(-1, HEADS, D), p, base)
    kv[0].append(rope((x @ W[m + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, D), p, base))
    kv[1].append((x @ W[m + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, D))
    K, V = (torch.cat(t).repeat_interleave(HEADS // KV_HEADS, 1) for t in kv)
    n, S = q.shape[0], K.shape[0]
    s = torch.einsum("qhd,khd->hqk", q, K) / math.sqrt(D)
    s = s.masked_fill(torch.arange(S)[None, None, :] > (S - n + torch.arange(n))[None, :, None], float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), V).reshape(n, H)
    h = h + o @ W[m + "self_attn.o_proj.weight"].T                       # residual = UN-normed hidden
    y = rms(h, W[m + "post_attention_layernorm.weight"])
    y = torch.nn.functional.silu(y @ W[m + "mlp.gate_proj.weight"].T) * (y @ W[m + "mlp.up_proj.weight"].T)
    return h + y @ W[m + "mlp.down_proj.weight"].T


def rederive(W, E, base, aux, full_ids):
    """An independent greedy chain from the saved files (what a loader must compute): [CHAIN, Vd] logits."""
    kv = ([], [])
    h = head_step(W, E, base, kv, aux[0] @ W["fc.weight"].T, full_ids[0, 1:], torch.arange(len(PROMPT)))[-1:]
    logits = []
    for s in range(CHAIN):
        lg = rms(h, W["norm.weight"]) @ W["lm_head.weight"].T
        logits.append(lg[0])
        t = int(lg[0].argmax()) + int(W["d2t"][int(lg[0].argmax())])
        if s + 1 < CHAIN:
            h = head_step(W, E, base, kv, h, torch.tensor([t]), torch.tensor([len(PROMPT) + s]))
    return torch.stack(logits)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="checkout of SafeAILab/EAGLE (contains eagle/model/)")
    ap.add_argument("--out", type=Path, default=REPO / "tests/fixtures/drafters/eagle3")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    cnets, EConfig = load_reference(args.src)
    target_dir, head_dir = args.out.resolve() / "tiny_target", args.out.resolve() / "tiny_head"

    target = build_target(target_dir)
    ids = torch.tensor([PROMPT])
    aux, hf_equal, token0, greedy = target_features(target, ids)
    write_head(cnets, EConfig, head_dir)
    ea = load_head(cnets, EConfig, head_dir, target_dir, target)
    rope_base = ea.midlayer.self_attn.rotary_emb.base

    full_ids = torch.tensor([PROMPT + [token0]])
    draft, draft_vocab_ids, draft_logits = authors_chain(ea, aux, full_ids)
    full = torch.full((CHAIN, VOCAB), float("-inf"))
    full[:, torch.arange(DRAFT_VOCAB) + ea.d2t] = draft_logits                # vLLM compute_logits layout

    ea.init_tree()   # cross-check 1: the authors' own tree drafter with top_k=1 is a chain
    ea.reset_kv()
    tree_tokens = ea.topK_genrate(aux, full_ids, None, None)[0][0].tolist()   # [token0, d0..d3]
    assert tree_tokens == [token0] + draft, (tree_tokens, draft)

    W = {k: (v.float() if v.is_floating_point() else v)
         for k, v in torch.load(head_dir / "pytorch_model.bin").items()}
    mine = rederive(W, target.model.embed_tokens.weight, rope_base, aux, full_ids)
    recheck = (mine - draft_logits).abs().max().item()
    assert recheck < 1e-4, recheck   # cross-check 2: independent re-derivation

    top2, T = draft_logits.topk(2, -1).values, len(PROMPT)
    ref = {
        "prompt_ids": torch.tensor(PROMPT),
        "aux_layer_ids": torch.tensor(AUX),               # stream entering these layers (= HF hidden_states[i])
        "aux_hidden": aux[0].clone(),                     # [T, 3H] concat in AUX order
        "fc_out": (aux[0] @ W["fc.weight"].T).clone(),    # [T, H]
        "target_next_token": token0,                      # x_T: the target's greedy token after the prompt
        "target_greedy": torch.tensor(greedy),            # target's own greedy continuation (6 tokens)
        "draft_tokens": torch.tensor(draft),              # [CHAIN] target-vocab ids (chain after token0)
        "draft_vocab_ids": torch.tensor(draft_vocab_ids),  # [CHAIN] draft-vocab argmaxes
        "draft_logits": draft_logits.clone(),             # [CHAIN, DRAFT_VOCAB] fp32
        "draft_logits_full": full,                        # [CHAIN, VOCAB] -inf outside the draft vocab
        "top1_margin": (top2[:, 0] - top2[:, 1]).clone(),
        "positions": {"prefill": list(range(T)), "steps": list(range(T, T + CHAIN - 1))},
        "head_rope_base": float(rope_base), "target_rope_theta": TARGET_ROPE_THETA,
        "hf_hidden_states_equal_prehook": hf_equal, "recheck_max_abs_diff": recheck,
        "topK_genrate_tokens": torch.tensor(tree_tokens),
    }
    torch.save(ref, args.out / "ref_out.pt")
    (target_dir / "generation_config.json").unlink(missing_ok=True)   # repeats config.json's ids; unused

    print(f"[eagle3 ref @ {COMMIT[:12]}] wrote {args.out}; aux layers {AUX}, head rope base {rope_base}")
    print(f"target next {token0}, greedy {greedy}; draft chain {draft} (draft-vocab ids {draft_vocab_ids})")
    print(f"top1 margins {[round(float(m), 4) for m in ref['top1_margin']]}; re-derivation max |diff| {recheck:.2e}")


if __name__ == "__main__":
    main()
