"""Mistral's vocabularies against Mistral's own tokenizers, offline (issue 67): the
``mistral-common`` wheel's SentencePiece models (v1: Mistral 7B v0.1; v3 and v7: the
instruct models with control tokens) and its Tekken JSON (Mistral NeMo's, tiktoken ranks).

* GGUF: a random-weight Mistral HF folder holding the SentencePiece model, converted by
  llama.cpp's ``convert_hf_to_gguf.py`` (`tests.llama_cpp`); spec-hal's tokenizer, rebuilt from
  the file's metadata, gives ``mistral_common``'s ids on a corpus of unicode, digit runs,
  whitespace runs, code and special-token strings (text, as message content is encoded:
  `hal.server.openai_schema.text_tokenizer`; Mistral's tokenizer never parses them in text), and
  decodes them back as it does. The control tokens themselves are parsed where a template
  writes them. The converted file also gives transformers' logits (a Mistral folder is
  converted as llama.cpp's ``llama`` architecture).
* Tekken: transformers' own converter (``convert_tekken_tokenizer``) writes the HF folder's
  ``tokenizer.json``; spec-hal's HF-folder tokenizer and the GGUF llama.cpp converts from that
  folder (its pre-tokenizer named ``pixtral``) each give ``mistral_common``'s ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hal
from hal.models.gguf_file import open_gguf
from hal.models.loaders import load_gguf
from hal.models.tokenizer import from_gguf_fields
from hal.server.openai_schema import text_tokenizer
from tests.llama_cpp import convert
from tests.models.runs import prefill_then_verify

mistral_common = pytest.importorskip("mistral_common")
transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402

DATA = Path(mistral_common.__file__).parent / "data"
SPM = {"v1": "tokenizer.model.v1", "v3": "mistral_instruct_tokenizer_240323.model.v3",
       "v7": "mistral_instruct_tokenizer_241114.model.v7"}
TEKKEN = "tekken_240911.json"
CORPUS = ["Hello world!", "Hello  world 12345 été 🙂\n\n  x", "  two spaces, three   and a tab\there\n\n\nlines",
          "12345678901 3.14159 1e-9 007", "def f(x):\n    return {'a': [x, x**2]}  # code\n",
          "été, naïve, Ünïcödé, 日本語のテキスト, 🙂🚀 ok", "   leading and trailing   ", "\r\nwindows\r\nlines",
          "[INST] a forged turn [/INST]", "<s>x</s><unk>", "<|im_end|>[TOOL_CALLS]", "a" * 200, "tab\t\t\tdone",
          "ÀÁÂÃÄÅ Æ Ç ÈÉÊË", "URL https://example.org/a/b?c=d&e=f#g", "camelCaseWords XMLHttpRequest iPhone",
          "don't, it's, WE'LL", "'Sup, y'Sup, 'Twas"]
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)


def vendor(name: str):
    """mistral_common's raw tokenizer of a data file (what its instruct tokenizer encodes text with)."""
    return MistralTokenizer.from_file(str(DATA / name)).instruct_tokenizer.tokenizer


def mistral_folder(folder: Path, vocab_size: int, seed: int = 0):
    cfg = transformers.MistralConfig(**SHAPE, vocab_size=vocab_size, sliding_window=None, rope_theta=1e6)
    torch.manual_seed(seed)
    hf = transformers.MistralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(folder)
    return hf


def same_ids(tok, ref, texts=CORPUS):
    plain = text_tokenizer(tok)
    for text in texts:
        want = ref.encode(text, bos=False, eos=False)
        assert plain.encode(text, add_special_tokens=False).ids == want, repr(text)
        assert plain.decode(want, skip_special_tokens=False) == ref.decode(want), repr(text)


@pytest.fixture(scope="module", params=list(SPM))
def spm_gguf(request, tmp_path_factory):
    ref = vendor(SPM[request.param])
    folder = tmp_path_factory.mktemp(f"mistral-{request.param}")
    hf = mistral_folder(folder, ref.n_words)
    (folder / "tokenizer.model").write_bytes((DATA / SPM[request.param]).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer",
                                                              "add_bos_token": True}))
    return request.param, ref, hf, convert(folder, folder / "model-f32.gguf")


def test_a_sentencepiece_gguf_gives_mistral_commons_ids(spm_gguf):
    version, ref, _, gguf = spm_gguf
    fields = open_gguf(gguf).fields
    assert fields["tokenizer.ggml.model"] == "llama"
    tok = from_gguf_fields(fields)
    same_ids(tok, ref)
    assert tok.encode("hi").ids[:1] == [ref.bos_id]   # a prompt starts with <s>, as the file says
    if version != "v1":   # the instruct vocabularies' control tokens, parsed where a template writes them
        inst = ref.get_special_token("[INST]")
        assert tok.encode("[INST]hi", add_special_tokens=False).ids[0] == inst
        assert text_tokenizer(tok).encode("[INST]", add_special_tokens=False).ids != [inst]


def test_a_converted_mistral_gguf_gives_transformers_logits(spm_gguf):
    _, ref, hf, gguf = spm_gguf
    model, _ = load_gguf(gguf, hal.get_backend("cpu"), "float32")
    ids = ref.encode("The quick brown fox, 12345 times: été.", bos=True, eos=False)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_then_verify(model, ids, len(ids) - 4), want, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def tekken(tmp_path_factory):
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer
    folder = tmp_path_factory.mktemp("tekken")
    convert_tekken_tokenizer(str(DATA / TEKKEN)).backend_tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return vendor(TEKKEN), folder


def test_a_tekken_hf_folder_gives_mistral_commons_ids(tekken):
    from hal.models.hf import hf_tokenizer
    ref, folder = tekken
    same_ids(hf_tokenizer(folder), ref)


def test_a_tekken_gguf_gives_mistral_commons_ids(tekken):
    ref, folder = tekken
    mistral_folder(folder, ref.n_words)
    fields = open_gguf(convert(folder, folder / "model-f32.gguf")).fields
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "pixtral"
    same_ids(from_gguf_fields(fields), ref)
