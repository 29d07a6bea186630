"""SmolLM2-135M's tokenizer and chat template from its GGUF, for tests that need a real vocabulary
(skips the test when the model cannot be fetched)."""

from __future__ import annotations

import pytest


def tokenizer_and_template():
    """(the `tokenizers.Tokenizer` rebuilt from the GGUF's metadata, its `ChatTemplate`, the GGUF's path)."""
    import hal
    from hal.models.fetch import fetch
    from hal.models.gguf_file import open_gguf
    from hal.models.tokenizer import chat_template_of, from_gguf_fields
    try:
        path = fetch("smollm2-135m")
    except hal.HalError as e:
        pytest.skip(f"model not fetchable: {e}")
    r = open_gguf(path)
    tok = from_gguf_fields(r.fields)
    return tok, chat_template_of(path), path
