"""Your model, as a new user runs it (issue 67): ``spec-hal generate --model <an HF folder>``.

At 8ab16ab a Qwen2 folder died with ``KeyError: 'self_attn.k_proj.bias'`` and a Llama folder with
``AttributeError: 'NoneType' object has no attribute 'encode'`` (no tokenizer). Here a random
Qwen2 folder written by transformers' ``save_pretrained``, with a ``tokenizer.json`` (SmolLM2's
vocabulary), its chat template in ``tokenizer_config.json`` and a ``generation_config.json``,
generates through the CLI, speculative output identical to plain; the prompt is the folder's
own template's rendering, encoded as transformers encodes it."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import torch
    from tests.smollm2 import tokenizer_and_template
    tok = tokenizer_and_template()[0]
    out = tmp_path_factory.mktemp("qwen2-folder")
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=tok.get_vocab_size(), eos_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>",
                                                           "bos_token": None}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return out


def test_generate_runs_an_hf_folder_with_its_own_tokenizer_and_template(folder, capsys):
    from hal.cli import main
    assert main(["generate", "--model", str(folder), "--prompt", "Count: 1 2 3 1 2 3", "--draft", "ngram",
                 "--max-tokens", "24", "--compare", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "outputs identical" in out, out


def test_the_prompt_is_the_folders_template_encoded_as_transformers_encodes_it(folder):
    from transformers import AutoTokenizer
    from hal.models.hf import hf_tokenizer
    from hal.models.tokenizer import chat_template_of, prompt_ids
    hf = AutoTokenizer.from_pretrained(str(folder))
    want = hf.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    got = prompt_ids(hf_tokenizer(folder), chat_template_of(folder), "hi there")
    assert got == list(want)
    from hal.models.hf import read_hf_config
    assert read_hf_config(folder).stop_ids == (2, 0)
