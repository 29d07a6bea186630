"""An HF folder's tokenizer (``tokenizer.json``, loaded by the ``tokenizers`` library as it is)
against the vendor's own tokenizer, offline (issue 67): Llama 3's ``tokenizer.model`` (tiktoken
ranks) from the ``llama-models`` wheel, turned into ``tokenizer.json`` by transformers' own
converter (``TikTokenConverter``) as Meta's published folders were, then loaded through
spec-hal's HF-folder path; its ids equal ``llama_models``' ``Tokenizer`` on a corpus of unicode,
digit runs, whitespace runs, code and special tokens. The folder's ``generation_config.json``
list of stop ids becomes the model's stop ids."""

from __future__ import annotations

import json

import pytest

llama_tok = pytest.importorskip("llama_models.llama3.tokenizer")
pytest.importorskip("tiktoken")

CORPUS = ["Hello world!", "  two spaces, three   and a tab\there\n\n\nlines", "12345678901 3.14159 1e-9 007",
          "def f(x):\n    return {'a': [x, x**2]}  # code\n", "été, naïve, Ünïcödé, 日本語のテキスト, 🙂🚀 ok",
          "<|begin_of_text|>hi<|eot_id|>", "mixed<|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|>",
          " leading and trailing ", "\r\nwindows\r\nlines", "a" * 300, "ÀÁÂÃÄÅ Æ Ç ÈÉÊË", "tab\t\t\tdone"]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    from pathlib import Path
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ref = llama_tok.Tokenizer.get_instance()
    path = Path(llama_tok.__file__).parent / "tokenizer.model"
    converted = TikTokenConverter(vocab_file=str(path), pattern=ref.pat_str,
                                  extra_special_tokens=list(ref.special_tokens)).converted()
    folder = tmp_path_factory.mktemp("llama3-tokenizer")
    converted.save(str(folder / "tokenizer.json"))
    return ref, folder


def test_llama3_ids_equal_the_vendors(llama3):
    from hal.models.hf import hf_tokenizer
    ref, folder = llama3
    tok = hf_tokenizer(folder)
    for text in CORPUS:
        want = ref.encode(text, bos=False, eos=False, allowed_special="all")   # special tokens parsed, as ours
        assert tok.encode(text, add_special_tokens=False).ids == want, text
        assert tok.decode(want, skip_special_tokens=False) == ref.decode(want)


def test_generation_configs_stop_list_becomes_the_models_stop_ids(llama3, tmp_path):
    """Llama 3 stops on <|end_of_text|>, <|eom_id|> and <|eot_id|> (its generation_config.json)."""
    from hal.models.hf import read_hf_config
    ref, _ = llama3
    stops = [ref.eos_id, ref.eom_id, ref.eot_id]
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "intermediate_size": 96, "vocab_size": 128256, "eos_token_id": ref.eos_id, "rms_norm_eps": 1e-5}))
    assert read_hf_config(tmp_path).stop_ids == (ref.eos_id,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    assert read_hf_config(tmp_path).stop_ids == tuple(stops)
