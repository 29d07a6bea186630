"""The runner's forward cost at M fed tokens (SmolLM2-135M, GGUF Q4_1, 200 cached tokens),
per dtype with the linear plan this machine measured for it (`hal.models.linear_plan`),
batch-invariant (the default) beside the plain path (``F.linear`` and the backend's
attention), batched one-token decodes in both modes, and HF transformers' one-token decode
on the same GGUF (fp32), all interleaved in one run (medians). ``--head-forms``: ``stored`` is
loaded twice more, with its lm_head as the plan chose it and in the other form (the Q8_0 codes
as stored, or a float copy), side by side. Writes benchmarks/results/forward.md.

    python benchmarks/forward.py [--reps 9] [--threads 2] [--dtypes stored --head-forms]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

import hal
from report import publish
from hal.engine.forward import forward
from hal.kv import KVPool
from hal.models.fetch import fetch
from hal.models.linear_layout import LinearPlan
from hal.models.linear_plan import offered_dtypes
from hal.models.machine import cpu_signature
from hal.models.llama import Llama
from hal.models.loaders import load_gguf

MS = (1, 2, 4, 5, 8, 9, 16, 17)
BATCHES = (4, 16)
CTX = 200


def ours(model, m):
    cfg = model.cfg
    pool = KVPool(model.be, 64, 16, cfg.kv_heads, cfg.head_dim, dtype=model.dtype, num_layers=cfg.layers)
    seq = pool.sequence()
    forward(model, pool, [seq], [list(range(10, 10 + CTX))], False)
    seq.commit(CTX)
    return lambda: forward(model, pool, [seq], [list(range(100, 100 + m))], True)


def batch_decode(model, R):
    """One forward of R requests decoding one token each, every one after CTX cached tokens."""
    cfg = model.cfg
    pool = KVPool(model.be, R * (CTX // 16 + 2), 16, cfg.kv_heads, cfg.head_dim, dtype=model.dtype,
                  num_layers=cfg.layers)
    seqs = [pool.sequence() for _ in range(R)]
    for s in seqs:
        forward(model, pool, [s], [list(range(10, 10 + CTX))], False)
        s.commit(CTX)
    return lambda: forward(model, pool, seqs, [[100]] * R, False)


CASES = [("decode, 1 request", ours, 1), ("verify, 5 tokens", ours, 5), ("verify, 9 tokens", ours, 9),
         ("decode, 4 requests", batch_decode, 4), ("decode, 16 requests", batch_decode, 16)]   # (name, make, n)


def interleaved(fns: dict, reps: int) -> dict:
    """Median seconds of each of ``fns`` (name -> closure), run in turn ``reps`` times,
    alternating the order from one round to the next."""
    times = {key: [] for key in fns}
    for rep in range(reps):
        for key in (fns if rep % 2 else reversed(list(fns))):
            t = time.perf_counter()
            fns[key]()
            times[key].append(time.perf_counter() - t)
    return {key: statistics.median(v) for key, v in times.items()}


def hf_decode(path):
    from transformers import AutoModelForCausalLM, DynamicCache
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    cache = DynamicCache()
    hf(torch.arange(10, 10 + CTX)[None], cache=cache, use_cache=True)

    def step():
        hf(torch.tensor([[100]]), cache=cache, use_cache=True)
        cache.crop(-1)     # back to CTX cached tokens
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--dtypes", default="float32,bfloat16,stored",
                    help="the dtypes to load (each with its measured plan; bfloat16 only where this CPU offers it; "
                         "stored: the int4 weights as stored)")
    ap.add_argument("--head-forms", action="store_true",
                    help="with stored: also the lm_head's other form (Q8_0 as stored, or float), side by side")
    ap.add_argument("--out", default="benchmarks/results/forward.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = fetch("smollm2-135m")
    offered = offered_dtypes() + ["stored"]   # stored: the file's int4 weights as stored (`--dtype stored`)
    dtypes = [d for d in args.dtypes.split(",") if d in offered]
    models = {}
    for dt in dtypes:   # one load per dtype: the weights are cast in place
        models[dt] = load_gguf(path, hal.get_backend("cpu"), dt)[0]
    if args.head_forms and "stored" in models:
        chosen = models["stored"].plan
        for head in ("float", "q8_0"):   # both forms under the same plan otherwise
            models[f"stored, head {head}"] = load_gguf(path, hal.get_backend("cpu"), plan=replace(chosen, head=head))[0]
        del models["stored"]
    fns = {}
    with torch.inference_mode():
        for dt, inv in models.items():
            plain = Llama(inv.cfg, inv.w, inv.be, batch_invariant=False,
                          plan=LinearPlan("linear", inv.dtype, (1,), weights=inv.plan.weights))
            for m in MS:
                fns[(dt, "invariant", m)] = ours(inv, m)
                fns[(dt, "plain", m)] = ours(plain, m)
            for r in BATCHES:
                fns[(dt, "invariant-batch", r)] = batch_decode(inv, r)
                fns[(dt, "plain-batch", r)] = batch_decode(plain, r)
        if not args.no_hf:
            fns[("hf", "hf", 1)] = hf_decode(path)
        times = {key: [] for key in fns}
        for f in fns.values():
            f()
        for _ in range(args.reps):
            for key, f in fns.items():
                t = time.perf_counter()
                f()
                times[key].append(time.perf_counter() - t)
    t = {key: statistics.median(v) for key, v in times.items()}
    sig = cpu_signature(args.threads)
    lines = ["# Runner forward cost at M fed tokens (SmolLM2-135M, 200 cached tokens), per dtype and plan", "",
             f"Command: `python benchmarks/forward.py --reps {args.reps} --threads {args.threads} --dtypes "
             f"{args.dtypes}{' --head-forms' * args.head_forms}`; torch "
             f"{torch.__version__}, {args.threads} threads, medians of {args.reps} interleaved runs, "
             f"{time.strftime('%Y-%m-%d')}.", "",
             f"CPU: {sig['cpu']}, {sig['cores']} cores; flags {' '.join(sig['flags']) or 'none'}.", ""]
    for dt, inv in models.items():
        i1, p1 = t[(dt, "invariant", 1)], t[(dt, "plain", 1)]
        lines += [f"## {dt}: linear plan {inv.plan.describe()}", "",
                  "| M fed tokens | batch-invariant ms | cost(M) / cost(1) | plain ms | cost(M) / cost(1) | "
                  "invariant / plain |", "|---:|---:|---:|---:|---:|---:|"]
        for m in MS:
            a, b = t[(dt, "invariant", m)], t[(dt, "plain", m)]
            lines.append(f"| {m} | {a * 1e3:.1f} | {a / i1:.2f} | {b * 1e3:.1f} | {b / p1:.2f} | {a / b:.2f} |")
        lines += ["", f"Batched decode: R requests, one token each, {CTX} cached tokens each.", "",
                  "| R | batch-invariant ms | plain ms | invariant / plain |", "|---:|---:|---:|---:|"]
        lines += [f"| {r} | {t[(dt, 'invariant-batch', r)] * 1e3:.1f} | {t[(dt, 'plain-batch', r)] * 1e3:.1f} | "
                  f"{t[(dt, 'invariant-batch', r)] / t[(dt, 'plain-batch', r)]:.2f} |" for r in BATCHES]
        lines.append("")
    if ("hf", "hf", 1) in t:
        h = t[("hf", "hf", 1)]
        lines += [f"HF transformers one-token decode (same GGUF, fp32, DynamicCache at {CTX} tokens): "
                  f"{h * 1e3:.1f} ms. spec-hal's one-token forward against it (target: 1.5x):", "",
                  "| dtype | batch-invariant | plain path |", "|---|---:|---:|"]
        lines += [f"| {dt} | {h / t[(dt, 'invariant', 1)]:.2f}x | {h / t[(dt, 'plain', 1)]:.2f}x |" for dt in models]
    publish(lines, args.out)


if __name__ == "__main__":
    with torch.inference_mode():   # as the engine's steps run (`SpeculativeDecoder.step`)
        main()
