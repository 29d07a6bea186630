"""The tokenizer rebuilt from GGUF metadata (byte-level BPE, digits split one by one),
plus the ChatML template of instruct models."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def from_gguf_fields(fields: dict) -> Tokenizer:
    """``fields``: GGUF metadata (tokens, merges) as plain Python values."""
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type")
    specials = [t for i, t in enumerate(tokens) if types is not None and types[i] == 3]  # CONTROL
    tok.add_special_tokens(specials)
    return tok


def chatml(prompt: str, system: str | None = DEFAULT_SYSTEM) -> str:
    """ChatML, as SmolLM2-Instruct's template renders one user turn."""
    sys_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_turn}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
