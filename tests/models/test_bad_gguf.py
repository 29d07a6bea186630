"""Bad GGUF files are refused with a `HalError` naming the file and what was expected, before any
tensor is read (issue 67). At 8ab16ab these were tracebacks: a non-GGUF file (``GGUF magic
invalid``), an empty file (an mmap error), a truncated GGUF (a reshape error), a GGUF without
merges (``TypeError``), and a GGUF whose embedding has fewer rows than its vocabulary loaded,
then raised ``IndexError`` mid-generation. Also refused by name: another architecture, a
pre-tokenizer this loader does not build exactly, a tensor the metadata does not explain.

Each case is a tiny llama GGUF written here with ``gguf.GGUFWriter``, changed in one way."""

from __future__ import annotations

import numpy as np
import pytest

import hal
from hal.errors import HalError
from hal.models.loaders import load_gguf

H, HEADS, KV, FFN, LAYERS = 32, 4, 2, 48, 1
TOKENS = ["t", "0", "1", "t0", "t1"] + [f"x{i}" for i in range(35)] + ["<|endoftext|>"]


def write(path, *, arch="llama", merges=True, embed_rows=len(TOKENS), pre="smollm", extra=None, drop=None,
          tokens=TOKENS, rope_dims=None):
    import gguf
    g = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", LAYERS)
    w.add_uint32(f"{arch}.embedding_length", H)
    w.add_uint32(f"{arch}.feed_forward_length", FFN)
    w.add_uint32(f"{arch}.attention.head_count", HEADS)
    w.add_uint32(f"{arch}.attention.head_count_kv", KV)
    if rope_dims is not None:   # RoPE over part of each head (Phi-4-mini's partial rotary factor)
        w.add_uint32(f"{arch}.rope.dimension_count", rope_dims)
    w.add_uint32(f"{arch}.context_length", 256)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    if merges:
        w.add_token_merges(["t 0", "t 1"] if merges is True else merges)
    w.add_eos_token_id(len(tokens) - 1)
    D = H // HEADS
    tensors = {"token_embd.weight": (embed_rows, H), "output_norm.weight": (H,)}
    for k, s in (("attn_norm", (H,)), ("ffn_norm", (H,)), ("attn_q", (HEADS * D, H)), ("attn_k", (KV * D, H)),
                 ("attn_v", (KV * D, H)), ("attn_output", (H, HEADS * D)), ("ffn_gate", (FFN, H)),
                 ("ffn_up", (FFN, H)), ("ffn_down", (H, FFN))):
        tensors[f"blk.0.{k}.weight"] = s
    tensors.update(extra or {})
    for name, shape in tensors.items():
        if name != drop:
            w.add_tensor(name, (g.standard_normal(shape) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path):
    return load_gguf(path, hal.get_backend("cpu"), "float32")


def test_the_tiny_file_itself_loads_and_generates(tmp_path):
    from hal.engine import Request, SpeculativeDecoder
    model, tok = load(write(tmp_path / "ok.gguf"))
    assert model.cfg.vocab == len(TOKENS) and tok.get_vocab_size() == len(TOKENS)
    assert len(SpeculativeDecoder(model, None, num_blocks=8).generate([Request([1, 2, 3], max_new_tokens=4)])[0]) == 4


def truncated(tmp_path):
    path = write(tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    return path


CASES = {
    "not-gguf": (lambda p: (p / "x.gguf").write_bytes(b"PK\x03\x04 a zip, not a model") and p / "x.gguf",
                 r"expected a GGUF file \(magic b'GGUF'\), got b'PK\\x03\\x04'"),
    "empty": (lambda p: (p / "e.gguf").write_bytes(b"") or p / "e.gguf", "expected a GGUF file, got an empty file"),
    "truncated": (truncated, "truncated"),
    "bad-merges": (lambda p: write(p / "b.gguf", merges=["t 9"]), "expected a BPE vocabulary and merges"),
    "no-merges": (lambda p: write(p / "m.gguf", merges=False), "expected tokenizer.ggml.merges"),
    "short-embedding": (lambda p: write(p / "s.gguf", embed_rows=len(TOKENS) - 5),
                        r"expected token_embd.weight of shape \[41, 32\] \(its metadata: 41 tokens\), got \[36, 32\]"),
    "architecture": (lambda p: write(p / "a.gguf", arch="gemma3"), "expected a GGUF of architecture llama, qwen2, qwen3, phi3, got 'gemma3'"),
    "pre-tokenizer": (lambda p: write(p / "p.gguf", pre="deepseek-llm"), "expected tokenizer.ggml.pre one of smollm"),
    "unknown-tensor": (lambda p: write(p / "u.gguf", extra={"blk.0.attn_sinks.weight": (HEADS,)}),
                       "expected only the tensors of a llama model, got blk.0.attn_sinks.weight"),
    "rope-freqs-shape": (lambda p: write(p / "r.gguf", extra={"rope_freqs.weight": (3,)}),
                         r"expected rope_freqs.weight F32 \[4\], got F32 \[3\]"),
    "missing-tensor": (lambda p: write(p / "d.gguf", drop="blk.0.ffn_up.weight"), "1 missing .blk.0.ffn_up.weight"),
    "partial-rotary": (lambda p: write(p / "q.gguf", rope_dims=H // HEADS // 2),
                       r"expected llama.rope.dimension_count 8 \(RoPE over the whole head\), got 4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_file_is_refused_naming_it(tmp_path, case):
    make, match = CASES[case]
    path = make(tmp_path)
    with pytest.raises(HalError, match=match) as e:
        load(path)
    assert str(path.name) in str(e.value)


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path):
    """``--draft model:<path>``: a draft whose vocabulary differs from the target's is refused,
    naming both sizes, or the first token that differs (issue 67)."""
    from hal.drafters.kinds import make_drafter, parse_draft
    target, tok = load(write(tmp_path / "target.gguf"))
    draft = write(tmp_path / "draft.gguf")
    spec = parse_draft(f"model:{draft}")
    be = hal.get_backend("cpu")
    assert make_drafter(spec, be, path=str(draft), vocabulary=(target.cfg.vocab, tok)) is not None   # the same
    with pytest.raises(HalError, match=r"--draft: expected a draft model with the target's vocabulary \(42 tokens\), "
                                       r"got .*draft.gguf with 41"):
        make_drafter(spec, be, path=str(draft), vocabulary=(42, None))
    other = write(tmp_path / "other.gguf", tokens=TOKENS[:7] + ["y6"] + TOKENS[8:])
    with pytest.raises(HalError, match="whose token 7 is 'y6' where the target's is 'x2'"):
        make_drafter(parse_draft(f"model:{other}"), be, path=str(other), vocabulary=(target.cfg.vocab, tok))
