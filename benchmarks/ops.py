"""Op benchmarks: each op on each available backend, and the cpu backend's
rejection sampler against HF transformers' ``_speculative_sampling`` applied row
by row (R=64, k=5, V=49152). Ratios come from side-by-side, interleaved timing in
one run (median of repeats). Writes a markdown table to benchmarks/results/.

    python benchmarks/ops.py [--reps 15] [--out benchmarks/results/ops-cpu.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

import hal


def timeit(fns: dict, reps: int) -> dict:
    """Interleave the candidates rep by rep; median seconds each."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def rejection_inputs(R=64, k=5, V=49152, seed=0):
    g = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(R, k, V, generator=g)
    # a target close to the draft, so acceptance is realistic (~0.5-0.8)
    target_logits = torch.cat([draft_logits, torch.randn(R, 1, V, generator=g)], 1) + 0.5 * torch.randn(
        R, k + 1, V, generator=g)
    drafts = torch.distributions.Categorical(logits=draft_logits).sample()
    return draft_logits, target_logits, drafts


def bench_vs_hf(reps: int) -> list[str]:
    try:
        from transformers.generation.utils import _speculative_sampling
    except ImportError:
        return ["HF transformers not installed (pip install -e '.[bench]'): comparison skipped."]
    R, k, V = 64, 5, 49152
    draft_logits, target_logits, drafts = rejection_inputs(R, k, V)
    be = hal.get_backend("cpu")
    cu = torch.arange(R + 1) * k
    seeds, offsets = torch.arange(R), torch.zeros(R, dtype=torch.long)
    ids = drafts.reshape(-1)

    def hf():
        for r in range(R):  # HF verifies one sequence at a time
            cand = torch.cat([torch.zeros(1, 3, dtype=torch.long), drafts[r:r + 1]], 1)
            _speculative_sampling(cand, draft_logits[r:r + 1], k, target_logits[r:r + 1])

    q_probs = draft_logits.reshape(R * k, V).softmax(-1)   # what the drafter's `sample` returned

    def ours(target_softmax: bool, draft_softmax: bool, checked: bool = True):
        def run():
            q = draft_logits.reshape(R * k, V).softmax(-1) if draft_softmax else q_probs
            p = target_logits.reshape(R * (k + 1), V).softmax(-1) if target_softmax else p_probs
            (be if checked else be.impl).verify_rejection(ids, cu, q, p, seeds, offsets, k)
        return run

    p_probs = target_logits.reshape(R * (k + 1), V).softmax(-1)
    t = timeit({"hf": hf, "probs": ours(False, False), "probs-unchecked": ours(False, False, False),
                "target": ours(True, False), "both": ours(True, True)}, reps)
    row = lambda label, key: f"| {label} | {t[key] * 1e3:.1f} | {t['hf'] / t[key]:.2f}x |"  # noqa: E731
    return [
        f"### Rejection sampling vs HF `_speculative_sampling` row by row (R={R}, k={k}, V={V})",
        "",
        "HF takes draft and target logits and softmaxes both inside. spec-hal's op takes probabilities:",
        "q comes from the drafter's `sample` (computed once while drafting), p from the target.",
        "",
        "| implementation | ms / batch | speedup vs HF |",
        "|---|---:|---:|",
        row("HF transformers `_speculative_sampling`, one row at a time (logits in)", "hf"),
        row("spec-hal cpu `verify_rejection`, probabilities in (value checks on, the default)", "probs"),
        row("spec-hal cpu `verify_rejection`, probabilities in, value checks off", "probs-unchecked"),
        row("spec-hal: target softmax + `verify_rejection` (q reused from drafting)", "target"),
        row("spec-hal: both softmaxes + `verify_rejection` (HF's exact inputs)", "both"),
    ]


def op_cases(be, R=64, k=5, V=32000):
    d = be.device_type
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(R, V, generator=g)
    target = torch.randn(R * (k + 1), V, generator=g)
    p = target.softmax(-1)
    q = torch.randn(R * k, V, generator=g).softmax(-1)
    ids = torch.randint(0, V, (R * k,), generator=g)
    cu = torch.arange(R + 1) * k
    seeds, offsets = torch.arange(R), torch.zeros(R, dtype=torch.long)
    parents = torch.tensor([-1, -1, 0, 1, 2][:k] + [-1] * max(0, k - 5)).repeat(R)
    hist = torch.randint(0, 50, (R, 1024), generator=g)
    ntok = torch.full((R,), 1024, dtype=torch.int32)
    bs, ctx, H, Hq, D = 16, 1024, 8, 32, 128
    nb = R * ctx // bs
    kc, vc = torch.randn(nb, bs, H, D, generator=g), torch.randn(nb, bs, H, D, generator=g)
    bt = torch.arange(nb, dtype=torch.int32).view(R, ctx // bs)
    key = torch.randn(R, H, D, generator=g)
    slots = torch.arange(R) * ctx + ctx - 1
    query = torch.randn(R, Hq, D, generator=g)
    seq = torch.full((R,), ctx)
    qsl = torch.arange(R + 1)
    t = lambda *xs: [x.to(d) for x in xs]  # noqa: E731
    temp, topk, topp = torch.ones(R), torch.full((R,), 50, dtype=torch.int32), torch.full((R,), 0.9)
    return {
        f"sample R={R} V={V} top-k 50 top-p 0.9": lambda: be.sample(*t(logits, temp, topk, topp, seeds, offsets)),
        f"ngram_propose R={R} L=1024 n=1..3 k={k}": lambda: be.ngram_propose(*t(hist, ntok), 1, 3, k),
        f"verify_greedy R={R} k={k} V={V}": lambda: be.verify_greedy(*t(ids, cu, target), k),
        f"verify_rejection R={R} k={k} V={V}": lambda: be.verify_rejection(*t(ids, cu, q, p, seeds, offsets), k),
        f"verify_typical R={R} k={k} V={V}": lambda: be.verify_typical(*t(ids, cu, p, seeds, offsets), k, 0.09, 0.3),
        f"verify_tree R={R} nodes={k} V={V}": lambda: be.verify_tree(*t(ids, cu, parents, p, q, seeds, offsets), k),
        f"write_kv T={R} H={H} D={D}": lambda: be.write_kv(*t(key, key, kc, vc, slots)),
        f"paged_attention decode R={R} ctx={ctx} bs={bs} Hq={Hq} Hkv={H}":
            lambda: be.paged_attention(*t(query, kc, vc, bt, seq, qsl), D ** -0.5, None),
        f"copy_kv M={R * k}": lambda: be.copy_kv(*t(kc, vc, slots[:R].repeat(k) - torch.arange(R * k) % k,
                                                    torch.arange(R * k))),
    }


def bench_ops(reps: int) -> list[str]:
    lines = ["### Ops per backend (median ms; ratio = cpu time / backend time)", "",
             "| op | backend | ms | vs cpu |", "|---|---|---:|---:|"]
    backends = [b.name for b in hal.list_backends() if b.available and not b.name.startswith("mutant")]
    cases = {name: op_cases(hal.get_backend(name)) for name in backends}
    for op in cases["cpu"]:
        t = timeit({name: cases[name][op] for name in backends}, reps)
        for name in backends:
            lines.append(f"| {op} | {name} | {t[name] * 1e3:.2f} | {t['cpu'] / t[name]:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/ops-cpu.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    header = [f"# spec-hal op benchmarks", "",
              f"Command: `python benchmarks/ops.py --reps {args.reps}`; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
              f"{time.strftime('%Y-%m-%d')}.", ""]
    body = bench_vs_hf(args.reps) + [""] + bench_ops(args.reps)
    text = "\n".join(header + body) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
