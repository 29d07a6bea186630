"""K-quants as stored (issues 67 and 69): the Q6_K lm_head llama-quantize keeps in the Q4_0 and
Q4_K_M files of Qwen3 and Llama 3.2, a Q6_K file's layers, a Q4_K_M file's layers (Q4_K, with
Q6_K in attn_v and ffn_down) and a Q5_K_M file's (Q5_K so), and Qwen2.5-0.5B's Q4_K_M mix (Q5_0, attn_v Q8_0, ffn_down Q6_K), run as the q4q8 kernel's Q6 and Q4K tiles (`hal.models.q4_rows`,
`hal.models.k_quants`: the file's codes and scales, no float copy; a fused linear of both types
is a `MixedWeight`, which the native loop runs as two parts).

Each file is written here with ``gguf.GGUFWriter``: random K-quant blocks (`random_q6_k`,
`random_q4_k`; ``gguf`` cannot quantize K types) or Q4_0 layers. The oracle for the values is ``gguf``'s own
dequantization (tests/models/test_q4_rows.py shows the codes times scales equal it bit for bit);
here the model that runs them as stored is compared with the same file run on those
dequantized floats: within the rows' int8 quantization (stated bound: 2% of the largest
logit; a misread tile, say one half-group's scale for the other's, is off by far more), and
greedy speculative output equals plain greedy under the stored plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hal
from hal.errors import HalError
from hal.engine import Request, SpeculativeDecoder
from hal.models import layer_loop, q4_rows
from hal.models.linear_layout import LinearPlan
from hal.models.loaders import load_gguf
from hal.models.k_quants import MixedWeight
from tests.models.runs import prefill_then_verify
from tests.models.test_q4_rows import random_q4_k, random_q5_0, random_q5_k, random_q6_k

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not q4_rows.available(), reason="no C++ compiler: no q4q8 kernel")

H, HEADS, KV, FFN, LAYERS, V = 256, 4, 2, 512, 2, 96
TOKENS = ["x", "1", "x1"] + [f"t{i}" for i in range(V - 4)] + ["<|endoftext|>"]
PARTS = {"attn_q": (H, H), "attn_k": (KV * H // HEADS, H), "attn_v": (KV * H // HEADS, H), "attn_output": (H, H),
         "ffn_gate": (FFN, H), "ffn_up": (FFN, H), "ffn_down": (H, FFN)}


Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K"}   # the parts a Q4_K_M file keeps in Q6_K (in some layers)
QWEN25_Q4_K_M = {"attn_v": "Q8_0", "ffn_down": "Q6_K"}   # Qwen2.5-0.5B's (rows of 896): Q5_0 elsewhere


def write(path, layers: str):
    """A tiny Qwen2-shaped llama GGUF: a tied Q6_K embedding (the lm_head), and layers in Q6_K,
    Q4_0 or Q4_K_M's mix (``layers``)."""
    g = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in (("block_count", LAYERS), ("embedding_length", H), ("feed_forward_length", FFN),
                   ("attention.head_count", HEADS), ("attention.head_count_kv", KV), ("context_length", 512)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (V - 1) + [3])
    w.add_token_merges(["x 1"])
    w.add_eos_token_id(V - 1)

    def q6(name, n, k, seed, kind="Q6_K"):
        if kind == "Q8_0":
            raw = gguf.quants.quantize((g.standard_normal((n, k)) * 0.05).astype(np.float32),
                                       gguf.GGMLQuantizationType.Q8_0)
        else:
            raw = {"Q6_K": random_q6_k, "Q4_K": random_q4_k, "Q5_0": random_q5_0, "Q5_K": random_q5_k}[kind](n, k, seed)
        w.add_tensor(name, raw.reshape(n, -1), raw_dtype=gguf.GGMLQuantizationType[kind])
    q6("token_embd.weight", V, H, 1)
    w.add_tensor("output_norm.weight", (1 + 0.1 * g.standard_normal(H)).astype(np.float32))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * g.standard_normal(H)).astype(np.float32))
        for j, (part, (n, k)) in enumerate(PARTS.items()):
            if layers != "q4_0":
                q6(f"blk.{i}.{part}.weight", n, k, 100 * i + j + 2, "Q6_K" if layers == "q6_k" else
                   QWEN25_Q4_K_M.get(part, "Q5_0") if layers == "q5_0" else
                   Q4_K_M.get(part, "Q5_K" if layers == "q5_k_m" else "Q4_K"))
            else:
                raw = gguf.quants.quantize((g.standard_normal((n, k)) * 0.05).astype(np.float32),
                                           gguf.GGMLQuantizationType.Q4_0)
                w.add_tensor(f"blk.{i}.{part}.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


IDS = [3, 50, 7, 7, 7, 91, 12, 0, 44, 5, 5, 60]


def logits(model) -> torch.Tensor:
    return prefill_then_verify(model, IDS, 8)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 0.02) -> None:
    """Logits within ``tol`` of the largest reference logit: 0.02 for rows of two codes; 0.04
    for llama.cpp's int8 rows (one code: each input off by up to half of amax/127, not amax/127/128)."""
    assert a.isfinite().all() and (a - b).abs().max() <= tol * b.abs().max(), float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("layers", ["q4_0", "q6_k", "q4_k_m", "q5_0", "q5_k_m"])
def test_a_q6_k_head_and_k_quant_layers_run_as_stored(tmp_path, layers):
    path = write(tmp_path / "m.gguf", layers)
    be = hal.get_backend("cpu")
    stored, _ = load_gguf(path, be, plan=LinearPlan("mm", torch.bfloat16, (1, 2, 4, 8), weights="q4q8", head="q6_k"))
    floats, _ = load_gguf(path, be, "float32")
    assert isinstance(stored.head_lin, q4_rows.Q4Weight) and stored.head_lin.q6k
    linears = {k: [stored.w[f"{i}.{k}"] for i in range(LAYERS)] for k in ("wqkv", "wo", "wgu", "wdown")}
    if layers in ("q4_k_m", "q5_k_m"):   # q and k Q4_K (Q5_K), v Q6_K: one linear of two tiles; the rest one type
        kq = q4_rows.Q4K_KIND if layers == "q4_k_m" else q4_rows.Q5K_KIND
        assert all(isinstance(t, MixedWeight) and [p.kind for p in t.parts] == [kq, q4_rows.Q6_KIND]
                   for t in linears["wqkv"])
        assert all(t.kind == kq for k in ("wo", "wgu") for t in linears[k]) and all(t.q6k for t in linears["wdown"])
    elif layers == "q5_0":   # Qwen2.5's Q4_K_M: q and k Q5_0, v Q8_0 (two parts); o, gate-up Q5_0; down Q6_K
        assert all(isinstance(t, MixedWeight) and [p.kind for p in t.parts] == [q4_rows.Q5_KIND, q4_rows.Q8_KIND]
                   for t in linears["wqkv"])
        assert all(t.q5 for k in ("wo", "wgu") for t in linears[k]) and all(t.q6k for t in linears["wdown"])
    else:
        assert all(isinstance(t, q4_rows.Q4Weight) and t.q6k == (layers == "q6_k") for ts in linears.values()
                   for t in ts)
    assert layer_loop.applies(stored) and stored.loop is not None   # two parts of a linear: LayerWeights.rows1
    assert "lm_head Q6_K as stored" in stored.plan.describe()
    kind = {"q4_0": "Q4_0", "q6_k": "Q6_K", "q4_k_m": "Q4_K", "q5_0": "Q5_0", "q5_k_m": "Q5_K"}[layers]   # the start-up line: how each type runs
    assert f"{kind} as stored" in stored.tensor_forms and "the lm_head Q6_K as stored" in stored.tensor_forms
    assert f"{kind} dequantized to float32" in floats.tensor_forms, floats.tensor_forms
    # a file with K-quants (every one here: a Q6_K head) runs llama.cpp's int8 rows, every linear
    assert stored.plan.codes == 1 and "one int8 code per input" in stored.plan.describe()
    assert all(t.codes == 1 for ts in linears.values() for t in ts) and stored.head_lin.codes == 1
    want = logits(floats)
    close(logits(stored), want, 0.04)
    two, _ = load_gguf(path, be, plan=stored.plan, row_codes=2)
    assert two.plan.codes == 2 and two.w["0.wqkv"].codes == 2 and two.head_lin.codes == 2
    close(logits(two), want)


def test_generate_says_how_each_tensor_type_runs(tmp_path, capsys):
    """``spec-hal generate`` on a Q4_K_M-shaped file names, at start-up, how each type runs."""
    from hal.cli import main
    path = write(tmp_path / "m.gguf", "q4_k_m")
    assert main(["generate", "--model", str(path), "--prompt", "x1x1", "--max-tokens", "4", "--draft", "none",
                 "--dtype", "stored"]) == 0
    err = capsys.readouterr().err
    assert "tensors: " in err and "Q4_K as stored, Q4K tiles" in err and "Q6_K as stored, Q6 tiles" in err, err
    assert "rows quantized per 32 to one int8 code per input (llama.cpp's int8 rows)" in err, err
    assert main(["generate", "--model", str(path), "--prompt", "x1x1", "--max-tokens", "4", "--draft", "none",
                 "--dtype", "stored", "--row-codes", "2"]) == 0   # the override: value and residual
    assert "rows quantized per 32 to int8 value and residual codes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:   # refused by the parser, naming the flag, before anything loads
        main(["generate", "--model", str(path), "--prompt", "x1", "--row-codes", "3"])
    assert e.value.code == 2 and "--row-codes" in capsys.readouterr().err
    with pytest.raises(HalError, match="codes"):
        load_gguf(path, hal.get_backend("cpu"), plan=LinearPlan("mm", torch.bfloat16, (1, 2, 4, 8), weights="q4q8",
                                                                 head="q6_k"), row_codes=3)


def test_greedy_speculation_on_a_q4_k_m_file_equals_plain_greedy(tmp_path):
    from hal.drafters import NgramDrafter
    model, _ = load_gguf(write(tmp_path / "m.gguf", "q4_k_m"), hal.get_backend("cpu"),
                         plan=LinearPlan("mm", torch.bfloat16, (1, 2, 4, 8), weights="q4q8", head="q6_k"))
    reqs = lambda k: [Request(list(IDS), max_new_tokens=40, k=k),  # noqa: E731
                      Request([5, 6, 5, 6, 5, 6, 5], max_new_tokens=40, k=k)]
    plain = SpeculativeDecoder(model, None, num_blocks=64).generate(reqs(0))
    spec = SpeculativeDecoder(model, NgramDrafter(model.be), num_blocks=64).generate(reqs(4))
    assert spec == plain


def test_the_plan_measures_a_q6_k_head_and_refuses_it_without_q4q8(tmp_path):
    from hal.errors import HalError
    path = write(tmp_path / "m.gguf", "q4_0")
    model, _ = load_gguf(path, hal.get_backend("cpu"), "stored")
    assert model.plan.weights in ("int4", "q4q8")
    if model.plan.weights == "q4q8":
        assert any(h["head"] == "q6_k" for h in model.plan_choice.heads), model.plan_choice.heads
    with pytest.raises(HalError, match="q6_k with q4q8"):
        LinearPlan.from_json({"layout": "mm", "dtype": "bfloat16", "widths": [1], "weights": "int4", "head": "q6_k"})


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # gguf's inf * 0, dequantizing
@pytest.mark.parametrize("kind,offset", [("Q4_K", 0), ("Q6_K", 208), ("Q5_0", 0), ("Q5_K", 2)])
def test_a_non_finite_block_scale_is_refused_naming_the_tensor(tmp_path, kind, offset):
    """A K-quant (or Q5_0) block whose fp16 d (or dmin) is inf or NaN: a `HalError` naming the
    tensor before anything runs, not a model whose products are NaN."""
    from hal.errors import HalError
    layers = {"Q4_K": "q4_k_m", "Q6_K": "q6_k", "Q5_0": "q5_0", "Q5_K": "q5_k_m"}[kind]
    path = write(tmp_path / "m.gguf", layers)
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == "blk.1.attn_q.weight")
    assert t.tensor_type.name == kind
    data = np.memmap(path, mode="r+", dtype=np.uint8)
    data[t.data_offset + offset:t.data_offset + offset + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    data.flush()
    with pytest.raises(HalError, match=r"blk\.1\.attn_q\.weight.*finite"):
        load_gguf(path, hal.get_backend("cpu"),
                  plan=LinearPlan("mm", torch.bfloat16, (1, 2, 4, 8), weights="q4q8", head="q6_k"))
    with pytest.raises(HalError, match=r"blk\.1\.attn_q\.weight.*finite"):   # dequantized: the same
        load_gguf(path, hal.get_backend("cpu"), "float32")
