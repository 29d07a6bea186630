"""The Llama runner on a tiny random model: HF safetensors loading (rotate-half RoPE)
agrees with the GGUF layout (llama.cpp's permuted q/k, interleaved RoPE), and a
batched ragged forward agrees with one request at a time."""

import json

import pytest
import torch

import hal
from hal.engine import Request, SpeculativeDecoder
from hal.engine.forward import forward
from hal.kv import KVPool
from hal.models.llama import Llama, LlamaConfig, _fuse
from hal.models.loaders import load_safetensors

H, HEADS, KV, D, FFN, V, LAYERS = 64, 4, 2, 16, 96, 50, 2


def hf_weights(g):
    w = {"model.embed_tokens.weight": torch.randn(V, H, generator=g) * 0.5,
         "model.norm.weight": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in [("self_attn.q_proj", (HEADS * D, H)), ("self_attn.k_proj", (KV * D, H)),
                            ("self_attn.v_proj", (KV * D, H)), ("self_attn.o_proj", (H, HEADS * D)),
                            ("mlp.gate_proj", (FFN, H)), ("mlp.up_proj", (FFN, H)), ("mlp.down_proj", (H, FFN))]:
            w[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.2
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return w


def gguf_permute(w, heads):
    """llama.cpp's convert: rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    w = hf_weights(g)
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", tie_word_embeddings=True,
        hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
        intermediate_size=FFN, vocab_size=V, rope_theta=10000.0, rms_norm_eps=1e-5)))
    be = hal.get_backend("cpu")
    hf = load_safetensors(folder, be)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "wq",
             "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo", "mlp.gate_proj": "wgate",
             "mlp.up_proj": "wup", "mlp.down_proj": "wdown"}
    gw = {"embed": w["model.embed_tokens.weight"], "norm": w["model.norm.weight"]}
    for i in range(LAYERS):
        for hf_name, ours in names.items():
            t = w[f"model.layers.{i}.{hf_name}.weight"]
            if ours == "wq":
                t = gguf_permute(t, HEADS)
            if ours == "wk":
                t = gguf_permute(t, KV)
            gw[f"{i}.{ours}"] = t
    cfg = LlamaConfig(hidden=H, layers=LAYERS, heads=HEADS, kv_heads=KV, head_dim=D, ffn=FFN, vocab=V,
                      rope_base=10000.0, eps=1e-5, rope_interleaved=True)
    return hf, Llama(cfg, _fuse(gw, LAYERS), be)


def logits_of(model, prompts):
    cfg = model.cfg
    pool = KVPool(model.be, 16, 16, cfg.kv_heads, cfg.head_dim, num_layers=cfg.layers)
    seqs = [pool.sequence() for _ in prompts]
    return forward(model, pool, seqs, prompts, True)[0]


def test_safetensors_and_gguf_layouts_agree(models):
    hf, gg = models
    prompts = [[1, 5, 7, 9, 11, 3], [4, 4, 2]]
    torch.testing.assert_close(logits_of(hf, prompts), logits_of(gg, prompts), atol=1e-4, rtol=1e-4)


def test_batched_forward_equals_one_at_a_time(models):
    hf, _ = models
    prompts = [[1, 5, 7, 9, 11, 3], [4, 4, 2], [8]]
    both = logits_of(hf, prompts)
    alone = torch.cat([logits_of(hf, [p]) for p in prompts])
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=1e-5)


def test_rope_actually_matters(models):
    hf, _ = models
    a = logits_of(hf, [[1, 2, 3, 1, 2, 3]])
    assert not torch.allclose(a[0], a[3], atol=1e-3), "same token at another position must differ"


def test_decoder_rejects_empty_prompt(models):
    hf, _ = models
    with pytest.raises(hal.HalError, match="prompt_ids"):
        SpeculativeDecoder(hf, None, num_blocks=8).generate([Request([])])
