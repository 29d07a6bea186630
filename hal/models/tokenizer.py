"""The tokenizer rebuilt from GGUF metadata: byte-level BPE with the pre-tokenizer its
``tokenizer.ggml.pre`` names, built as the model's own ``tokenizer.json`` builds it (`PRE`); a
model's own chat template (`chat_template_of`: the GGUF's ``tokenizer.chat_template``, or an
HF folder's ``chat_template.jinja`` / ``tokenizer_config.json``); and ``chatml``, SmolLM2's
rendering of one user turn (the training data's)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from hal.errors import HalError
from hal.models.chat_template import ChatTemplate

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# the split patterns of the published tokenizer.json files (llama.cpp's llama-vocab.cpp quotes them)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Mistral's Tekken (its tekken.json "pattern"; llama.cpp names the converted file's pre-tokenizer
# tekken or, for the tokenizer.json transformers' converter writes, pixtral)
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Pre:
    """How a ``tokenizer.ggml.pre`` value's tokenizer.json splits text before BPE."""

    split: str | None            # a regex split (isolated), then byte-level without its own regex
    digits: bool = False         # every digit on its own first (SmolLM2)
    nfc: bool = False            # NFC-normalized first (Qwen2)
    ignore_merges: bool = False  # a whole pre-token found in the vocabulary is one token (Llama 3, tiktoken's rule)

    def pre_tokenizer(self):
        if self.split is None:   # GPT-2's own regex inside ByteLevel
            parts = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        else:
            parts = [pre_tokenizers.Split(Regex(self.split), behavior="isolated", invert=False),
                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        return pre_tokenizers.Sequence(([pre_tokenizers.Digits(individual_digits=True)] if self.digits else []) + parts)


PRE = {"smollm": Pre(None, digits=True), "llama-bpe": Pre(LLAMA3_SPLIT, ignore_merges=True),
       "llama3": Pre(LLAMA3_SPLIT, ignore_merges=True), "llama-v3": Pre(LLAMA3_SPLIT, ignore_merges=True),
       "smaug-bpe": Pre(LLAMA3_SPLIT), "qwen2": Pre(QWEN2_SPLIT, nfc=True),
       "tekken": Pre(TEKKEN_SPLIT, ignore_merges=True), "pixtral": Pre(TEKKEN_SPLIT, ignore_merges=True)}
CONTROL, USER_DEFINED = 3, 4   # GGUF token types


def from_gguf_fields(fields: dict) -> Tokenizer:
    """``fields``: a GGUF's metadata (``tokenizer.ggml.*``) as plain Python values. Byte-level BPE
    (``tokenizer.ggml.model`` ``gpt2``) with the pre-tokenizer ``tokenizer.ggml.pre`` names (a
    name not in `PRE` is a `HalError`: a guess would tokenize silently wrong; none at all is
    SmolLM2's, the bundled file's), or SentencePiece BPE (``llama``: Llama 2, Mistral), as
    transformers' converter builds it. The BOS is added to a prompt where the file says
    (``tokenizer.ggml.add_bos_token``; Llama 3's pre-tokenizers imply it, as llama.cpp)."""
    kind = fields.get("tokenizer.ggml.model") or "gpt2"
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or []
    if kind == "llama":
        tok, add_bos = _sentencepiece(fields, tokens), fields.get("tokenizer.ggml.add_bos_token", True)
    elif kind == "gpt2":
        name = fields.get("tokenizer.ggml.pre") or "smollm"
        if name not in PRE:
            raise HalError(f"tokenizer.ggml.pre: expected one of {', '.join(PRE)}, got {name!r}", arg="model")
        pre = PRE[name]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre.ignore_merges))
        if pre.nfc:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre.pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        add_bos = fields.get("tokenizer.ggml.add_bos_token", pre.ignore_merges)   # llama.cpp: llama3 adds it
    else:
        raise HalError(f"tokenizer.ggml.model: expected gpt2 (byte-level BPE) or llama (SentencePiece), got "
                       f"{kind!r}", arg="model")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if add_bos and isinstance(bos, int) and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], bos)])
    return tok


def _sentencepiece(fields: dict, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE from a GGUF (tokens and scores), as transformers' converter builds a
    Llama / Mistral ``tokenizer.json`` (legacy): merges of every split of a piece into two
    pieces, ordered by the merged piece's score; "▁" before the text and for every space; bytes
    the vocabulary lacks as <0xNN> pieces."""
    scores = fields.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise HalError(f"tokenizer.ggml.scores: expected one score per token ({len(tokens)}), got "
                       f"{len(scores or [])}", arg="model")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk = fields.get("tokenizer.ggml.unknown_token_id", 0)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=tokens[unk],
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def chatml(prompt: str, system: str | None = DEFAULT_SYSTEM) -> str:
    """ChatML, as SmolLM2-Instruct's template renders one user turn."""
    sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_turn}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_of(path: str | Path) -> ChatTemplate | None:
    """The chat template ``path`` ships, with its special tokens as the template's variables
    (``bos_token``, ``eos_token``, ...), as transformers passes them; None if it has none. A
    GGUF: ``tokenizer.chat_template`` and the tokens at ``tokenizer.ggml.bos_token_id`` /
    ``eos_token_id``. An HF folder: ``chat_template.jinja`` (transformers 5), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: the
    ``default`` one), with its ``bos_token`` etc."""
    path = Path(path)
    if not path.is_dir():
        from hal.models.gguf_file import open_gguf
        r = open_gguf(path)
        source = r.field("tokenizer.chat_template")
        if source is None:
            return None
        tokens = r.field("tokenizer.ggml.tokens") or []
        specials = {}
        for name, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                          ("unk_token", "tokenizer.ggml.unknown_token_id"),
                          ("pad_token", "tokenizer.ggml.padding_token_id")):
            i = r.field(key)
            if isinstance(i, int) and 0 <= i < len(tokens):
                specials[name] = tokens[i]
        return ChatTemplate(source, specials, f"{path.name}: tokenizer.chat_template")
    config_file = path / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (OSError, ValueError) as e:
        raise HalError(f"{config_file}: expected a JSON object, got unreadable text ({e})") from None
    if not isinstance(config, dict):
        raise HalError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    specials = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                               "mask_token") if (t := _token_text(config.get(k))) is not None}
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return ChatTemplate(jinja.read_text(), specials, str(jinja))
    source = config.get("chat_template")
    if isinstance(source, list):   # named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if source is None:
        return None
    return ChatTemplate(source, specials, f"{config_file}: chat_template")


def prompt_ids(tok, template: ChatTemplate | None, prompt: str) -> list[int]:
    """One user turn (``prompt``) as the CLI sends it: rendered by the model's chat template with
    its generation prompt and encoded as transformers' ``apply_chat_template(tokenize=True)`` does
    (the template writes any BOS itself: no special tokens added); a model without a template
    gets ``prompt`` as it is, encoded as a completion prompt (the tokenizer's own BOS, if any)."""
    if template is None:
        return tok.encode(prompt).ids
    return tok.encode(template.render_text([{"role": "user", "content": prompt}]), add_special_tokens=False).ids
