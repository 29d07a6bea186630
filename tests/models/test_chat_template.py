"""A model's chat template renders as transformers' ``apply_chat_template`` renders it (the oracle:
transformers itself, over the same template and special tokens): templates of our own written
with the constructs published templates use (loops over messages, conditionals on roles,
``raise_exception``, ``add_generation_prompt``, ``bos_token`` / ``eos_token``, ``namespace``,
``loop.first`` / ``loop.last``, ``trim``, ``tojson``), and SmolLM2's, from its GGUF. A template that
raises is a `HalError` naming the messages; the sandbox refuses what transformers' refuses."""

from __future__ import annotations

import pytest

from hal.errors import HalError
from hal.models.chat_template import ChatTemplate

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}

CHATML_DEFAULT_SYSTEM = (  # Qwen2.5-like: a default system turn when none is given
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3_LIKE = (  # bos, headers, trimmed content, eot
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

MISTRAL_LIKE = (  # alternation enforced with raise_exception, eos after each answer, a namespace
    "{%- set ns = namespace(system='') %}{%- if messages[0]['role'] == 'system' %}"
    "{%- set ns.system = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}{{ bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.first %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{%- else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}")

JSON_AND_LOOP = (  # tojson (no HTML escaping), loop.last, a for-else and a break (loopcontrols)
    "{% for m in messages %}{{ m.role | upper }}: {{ m.content | tojson }}{% if not loop.last %}\n{% endif %}"
    "{% if m.content == 'stop' %}{% break %}{% endif %}{% else %}(empty){% endfor %}"
    "{% if add_generation_prompt %}\nASSISTANT:{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello <b>&</b> \u00e9t\u00e9 \U0001F642"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Two  spaces  "},
     {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And 12345?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "stop"},
     {"role": "assistant", "content": "never shown"}],
]


def hf_render(source: str, messages, add_generation_prompt: bool) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), **SPECIALS)
    return tok.apply_chat_template(messages, chat_template=source, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("source", [CHATML_DEFAULT_SYSTEM, LLAMA3_LIKE, JSON_AND_LOOP],
                         ids=["chatml-default-system", "llama3-like", "json-and-loop"])
def test_renders_as_transformers(source, conversation, gen):
    msgs = CONVERSATIONS[conversation]
    assert ChatTemplate(source, SPECIALS).render_text(msgs, gen) == hf_render(source, msgs, gen)


def test_a_template_that_raises_is_a_halerror_naming_the_messages():
    t = ChatTemplate(MISTRAL_LIKE, SPECIALS)
    ok = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
          {"role": "user", "content": "u2"}]
    assert t.render_text(ok) == hf_render(MISTRAL_LIKE, ok, True)
    bad = [{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}]
    with pytest.raises(Exception, match="must alternate"):
        hf_render(MISTRAL_LIKE, bad, True)   # the oracle refuses it too
    with pytest.raises(HalError, match="^messages: expected a conversation this model's chat template accepts.*"
                                       "must alternate") as e:
        t.render_text(bad)
    assert e.value.arg == "messages"


def test_the_sandbox_refuses_what_transformers_refuses():
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(Exception):
        hf_render(escape, CONVERSATIONS[0], True)
    with pytest.raises(HalError, match="^messages: "):
        ChatTemplate(escape).render_text(CONVERSATIONS[0])
    with pytest.raises(HalError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_content_spans_are_where_the_content_is_and_unknown_where_the_template_changes_it():
    msgs = CONVERSATIONS[1]
    r = ChatTemplate(CHATML_DEFAULT_SYSTEM, SPECIALS).render(msgs)
    assert [r.text[a:b] for a, b in r.contents] == [m["content"] for m in msgs]
    assert ChatTemplate(LLAMA3_LIKE, SPECIALS).render(msgs).contents is None   # | trim changes "  Two  spaces  "
    assert ChatTemplate(LLAMA3_LIKE, SPECIALS).render(CONVERSATIONS[0]).contents is not None


def test_smollm2s_template_from_its_gguf_renders_as_transformers():
    from hal.models.gguf_file import open_gguf
    from tests.smollm2 import tokenizer_and_template
    _, t, path = tokenizer_and_template()
    source = open_gguf(path).field("tokenizer.chat_template")
    assert t.specials["eos_token"] == "<|im_end|>" and t.specials["bos_token"] == "<|im_start|>"
    for msgs in CONVERSATIONS[:2]:
        for gen in (True, False):
            assert t.render_text(msgs, gen) == hf_render(source, msgs, gen)
    # its own default system turn, added by the template (none is added by spec-hal)
    assert t.render_text(CONVERSATIONS[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
