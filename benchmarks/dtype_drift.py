"""What bfloat16, and the int4 weights as stored, change against float32 on the bundled model
(SmolLM2-135M, GGUF Q4_1): on each bundled prompt (the demo's and the end-to-end benchmark's),
the float32 greedy continuation is teacher-forced through both (each with the linear plan this
machine measured for it), and the logits compared row by row; then each generates greedily
on its own and the outputs are compared token by token. Writes benchmarks/results/dtype.md.
``--model`` takes another GGUF with a chat vocabulary (a K-quant file: its tensors as stored
against the same file dequantized to float32).

    python benchmarks/dtype_drift.py [--max-new-tokens 64] [--model FILE.gguf --out ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from benchmarks.e2e import PROMPTS as E2E_PROMPTS  # noqa: E402
from hal.cli import DEMO_PROMPTS  # noqa: E402
from hal.engine import Request, SpeculativeDecoder  # noqa: E402
from hal.engine.forward import forward  # noqa: E402
from hal.kv import KVPool  # noqa: E402
from hal.models.fetch import fetch  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402
from hal.models.loaders import load_gguf  # noqa: E402
from hal.models.tokenizer import chatml  # noqa: E402


def greedy(model, ids, n):
    dec = SpeculativeDecoder(model, None, num_blocks=64)
    return dec.generate([Request(ids, max_new_tokens=n, k=0, stop_ids=model.cfg.stop_ids)])[0]


def logits_along(model, ids):
    cfg = model.cfg
    pool = KVPool(model.be, -(-len(ids) // 16) + 1, 16, cfg.kv_heads, cfg.head_dim, dtype=model.dtype,
                  num_layers=cfg.layers)
    return forward(model, pool, [pool.sequence()], [ids], True)[0]


def drift(fp32, other, tok, prompts, n):
    """Per prompt: (label, tokens, max and mean |logit diff|, fp32 logit std, argmax agreement,
    own greedy identical, first differing token) of ``other`` against ``fp32``."""
    rows = []
    for label, prompt in prompts:
        ids = tok.encode(chatml(prompt)).ids
        ref = greedy(fp32, ids, n)
        forced = ids + ref
        a, b = logits_along(fp32, forced), logits_along(other, forced)
        gen = slice(len(ids) - 1, len(forced) - 1)      # the rows that chose each generated token
        diff = (a[gen] - b[gen]).abs()
        top_agree = int((a[gen].argmax(-1) == b[gen].argmax(-1)).sum())
        own = greedy(other, ids, n)
        first = next((j for j, (x, y) in enumerate(zip(ref, own)) if x != y), None)
        rows.append((label, len(ref), float(diff.max()), float(diff.mean()),
                     float((a[gen].float().std(-1)).mean()), top_agree, own == ref, first))
    return rows


WEIGHTS = {"bfloat16": "the GGUF's Q4_1 values dequantized to float32, then rounded to bfloat16 for the linear layers",
           "int4": "the layers' Q4_1 blocks as stored, multiplied by the int4pack kernel (scales and zeros rounded to "
                   "the rows' dtype); ",
           "q4q8": "the layers' Q4_1 blocks as stored, times rows quantized per 32 to two int8 codes (value and "
                   "residual; `hal.models.q4_rows`); "}
HEAD = {"float": "the Q8_0 head dequantized, then in the plan's float dtype",
        "q8_0": "the Q8_0 head's codes as stored (int4pack: two int4 halves, scales rounded to the rows' dtype; q4q8: "
                "Q8 tiles, fp16 scales)"}


def table(name: str, model, rows, bundled: bool = True) -> list[str]:
    weights = (WEIGHTS[model.plan.weights if name == "stored" else name] + (HEAD[model.plan.head] if name == "stored"
                                                                              else "")) if bundled else \
        f"the file's tensors as the start-up line says ({model.tensor_forms})"
    lines = [f"## {name} ({model.plan.describe()})", "", f"Weights: {weights}; embeddings, norms, the residual "
             "stream, attention and the logits stay float32; the KV cache is in the plan's dtype.", "",
             "| prompt | tokens | max abs logit diff | mean abs logit diff | logit std (fp32) | argmax agreement | "
             "greedy output identical | first differing token |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for label, n, mx, mean, std, agree, same, first in rows:
        lines.append(f"| {label} | {n} | {mx:.3f} | {mean:.4f} | {std:.2f} | {agree}/{n} | {'yes' if same else 'no'} | "
                     f"{'—' if first is None else first} |")
    agree, total, same = sum(r[5] for r in rows), sum(r[1] for r in rows), sum(r[6] for r in rows)
    return lines + ["", f"Overall: argmax agreement {agree}/{total} ({agree / max(1, total):.3f}); identical greedy "
                    f"outputs on {same} of {len(rows)} prompts.", ""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/dtype.md")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path, be = args.model or fetch("smollm2-135m"), hal.get_backend("cpu")
    fp32, tok = load_gguf(path, be, "float32")
    prompts = [(f"demo: {label}", p) for label, p in DEMO_PROMPTS] + [(label, p) for label, _, p in E2E_PROMPTS]
    title = "SmolLM2-135M (GGUF Q4_1)" if args.model is None else Path(args.model).name
    command = f"--max-new-tokens {args.max_new_tokens}" + (f" --model {args.model} --out {args.out}" if args.model else "")
    lines = [f"# Each dtype against float32 on {title}", "",
             f"Command: `python benchmarks/dtype_drift.py {command}`; "
             f"{time.strftime('%Y-%m-%d')}; {machine_line()}; float32 plan {fp32.plan.describe()}.", "",
             "Teacher-forced on the float32 greedy continuation: |logit difference| over the rows that chose each "
             "generated token, and how often the two argmaxes agree; then each dtype's own greedy output.", ""]
    with torch.inference_mode():
        for name in ("bfloat16", "stored"):
            try:
                other = load_gguf(path, be, name)[0]
            except hal.HalError as e:   # no bf16 unit, or no int4 kernel here: say so
                lines += [f"## {name}", "", f"Not offered on this machine: {e}", ""]
                continue
            lines += table(name, other, drift(fp32, other, tok, prompts, args.max_new_tokens), args.model is None)
    publish(lines, args.out)


if __name__ == "__main__":
    main()
