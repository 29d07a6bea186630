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


_ACTIVE: dict = {}  # the backends being timed: each one's `synchronize` hook runs around every timing


def _backend(name: str):
    _ACTIVE[name] = be = hal.get_backend(name)
    return be


def _sync() -> None:
    for be in _ACTIVE.values():
        be.synchronize()


def timeit(fns: dict, reps: int) -> dict:
    """Interleave the candidates rep by rep; median seconds each (device synced)."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up (and Triton compilation)
    for _ in range(reps):
        for k, f in fns.items():
            _sync()
            t = time.perf_counter()
            f()
            _sync()
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


def hf_row_loop(speculative_sampling, draft_logits, target_logits, drafts) -> None:
    """HF's ``_speculative_sampling`` over a batch, one sequence at a time (as HF verifies)."""
    R, k = drafts.shape
    for r in range(R):
        cand = torch.cat([torch.zeros(1, 3, dtype=torch.long), drafts[r:r + 1]], 1)
        speculative_sampling(cand, draft_logits[r:r + 1], k, target_logits[r:r + 1])


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
        hf_row_loop(_speculative_sampling, draft_logits, target_logits, drafts)

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


def bench_from_logits(reps: int) -> list[str]:
    """`verify_rejection_logits` on the target's logits (vLLM's input) beside HF's row loop and
    beside one `torch.logsumexp` pass over the same logits, on 1 and on 2 threads."""
    try:
        from transformers.generation.utils import _speculative_sampling
    except ImportError:
        return ["HF transformers not installed (pip install -e '.[bench]'): from-logits comparison skipped."]
    from hal.integrations.vllm import rejection_sample
    R, k, V = 64, 5, 49152
    draft_logits, target_logits, drafts = rejection_inputs(R, k, V)
    be = hal.get_backend("cpu")
    cu, ids = torch.arange(R + 1) * k, drafts.reshape(-1)
    seeds, offsets, temp = torch.arange(R), torch.zeros(R, dtype=torch.long), torch.ones(R)
    q = draft_logits.reshape(R * k, V).softmax(-1)           # the drafter's `sample` output, reused
    target = target_logits.reshape(R * (k + 1), V)
    md = type("SpecDecodeMetadata", (), dict(draft_token_ids=ids, cu_num_draft_tokens=cu[1:], max_spec_len=k))
    vllm_logits = target_logits[:, :k].reshape(R * k, V)
    bonus = torch.zeros(R, 1, dtype=torch.long)

    def hf():
        hf_row_loop(_speculative_sampling, draft_logits, target_logits, drafts)

    fns = {"hf": hf,
           "lse": lambda: torch.logsumexp(target, -1),
           "op": lambda: be.impl.verify_rejection_logits(ids, cu, q, target, temp, seeds, offsets, k),
           "checked": lambda: be.verify_rejection_logits(ids, cu, q, target, temp, seeds, offsets, k),
           "softmax": lambda: be.impl.verify_rejection(ids, cu, q, target.softmax(-1), seeds, offsets, k),
           "vllm": lambda: rejection_sample(md, q, vllm_logits, bonus, temperature=temp, seeds=seeds, backend=be)}
    labels = {"hf": "HF `_speculative_sampling`, one row at a time",
              "lse": "one `torch.logsumexp` pass over the same `[N+R, V]` logits",
              "op": "spec-hal cpu `verify_rejection_logits`, value checks off",
              "checked": "spec-hal cpu `verify_rejection_logits`, value checks on (the cpu default)",
              "softmax": "target softmax + `verify_rejection` (the path before this op), checks off",
              "vllm": "`hal.integrations.vllm.rejection_sample` (vLLM's layout: `[N, V]` logits + bonus ids)"}
    lines = [f"### Verify from logits (R={R}, k={k}, V={V}, temperature 1, q reused from drafting)", "",
             "Target: the op at least 2x HF's row loop and at most 1.5x one logsumexp pass, on 1 and 2 threads.", ""]
    threads = torch.get_num_threads()
    for n in (1, 2):
        torch.set_num_threads(n)
        t = timeit(fns, reps)
        lines += [f"#### {n} thread{'s' if n > 1 else ''}", "",
                  "| implementation | ms / batch | speedup vs HF | cost vs one logsumexp |", "|---|---:|---:|---:|"]
        lines += [f"| {labels[key]} | {t[key] * 1e3:.1f} | {t['hf'] / t[key]:.2f}x | {t[key] / t['lse']:.2f}x |"
                  for key in fns]
        hf_ok, lse_ok = t["hf"] / t["op"] >= 2, t["op"] / t["lse"] <= 1.5
        lines += ["", f"Op vs targets on {n} thread{'s' if n > 1 else ''}: {t['hf'] / t['op']:.2f}x HF "
                      f"({'met' if hf_ok else 'missed'}), {t['op'] / t['lse']:.2f}x logsumexp "
                      f"({'met' if lse_ok else 'missed'}).", ""]
    torch.set_num_threads(threads)
    return lines


def op_cases(be, R=64, k=5, V=32000, ctx=1024):
    """Realistic inputs for every op at one shape, on the backend's device."""
    d = be.device_type
    g = torch.Generator().manual_seed(1)
    t = lambda *xs: [x.to(d) for x in xs]  # noqa: E731 (no copy for tensors already there)
    logits = torch.randn(R, V, generator=g)
    p = torch.randn(R * (k + 1), V, generator=g).softmax(-1)
    q = torch.randn(R * k, V, generator=g).softmax(-1)
    ids = torch.randint(0, V, (R * k,), generator=g)
    cu = torch.arange(R + 1) * k
    seeds, offsets = torch.arange(R), torch.zeros(R, dtype=torch.long)
    parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, k)]).repeat(R)  # a binary tree
    hist = torch.randint(0, 50, (R, 1024), generator=g)
    ntok = torch.full((R,), 1024, dtype=torch.int32)
    bs, H, Hq, D = 16, 8, 32, 128
    nb = R * ctx // bs
    kc, vc = torch.randn(nb, bs, H, D, device=d), torch.randn(nb, bs, H, D, device=d)  # big: made in place
    bt = torch.arange(nb, dtype=torch.int32).view(R, ctx // bs)
    key = torch.randn(R, H, D, generator=g)
    slots = torch.arange(R) * ctx + ctx - 1
    query = torch.randn(R, Hq, D, generator=g)
    seq, qsl = torch.full((R,), ctx), torch.arange(R + 1)
    qv = torch.randn(R * (k + 1), Hq, D, generator=g)
    qsl_v = torch.arange(R + 1) * (k + 1)
    temp, topk, topp = torch.ones(R), torch.full((R,), 50, dtype=torch.int32), torch.full((R,), 0.9)
    a = dict(logits=t(logits, temp, topk, topp, seeds, offsets), hist=t(hist, ntok),
             greedy=t(ids, cu, p), rej=t(ids, cu, q, p, seeds, offsets),
             rejl=t(ids, cu, q, p.log(), temp, seeds, offsets), typ=t(ids, cu, p, seeds, offsets),
             tree=t(ids, cu, parents, p, q, seeds, offsets), kv=t(key, key, kc, vc, slots),
             dec=t(query, kc, vc, bt, seq, qsl), ver=t(qv, kc, vc, bt, seq, qsl_v),
             cp=t(kc, vc, slots.repeat(k) - torch.arange(R * k) % k, torch.arange(R * k)))
    return {
        ("sample", "top-k 50, top-p 0.9"): lambda: be.sample(*a["logits"]),
        ("ngram_propose", "L=1024, n 1..3"): lambda: be.ngram_propose(*a["hist"], 1, 3, k),
        ("verify_greedy", ""): lambda: be.verify_greedy(*a["greedy"], k),
        ("verify_rejection", ""): lambda: be.verify_rejection(*a["rej"], k),
        ("verify_rejection_logits", ""): lambda: be.verify_rejection_logits(*a["rejl"], k),
        ("verify_typical", ""): lambda: be.verify_typical(*a["typ"], k, 0.09, 0.3),
        ("verify_tree", "binary tree"): lambda: be.verify_tree(*a["tree"], k),
        ("write_kv", f"H={H} D={D}"): lambda: be.write_kv(*a["kv"]),
        ("paged_attention", f"decode ctx={ctx} bs={bs} Hq={Hq} Hkv={H} D={D}"):
            lambda: be.paged_attention(*a["dec"], D ** -0.5, None),
        ("paged_attention", f"verify q_len={k + 1} ctx={ctx} bs={bs}"):
            lambda: be.paged_attention(*a["ver"], D ** -0.5, None),
        ("copy_kv", f"M={R * k}"): lambda: be.copy_kv(*a["cp"]),
    }


# (R, k, V, ctx) grids. --full is for a GPU; the cpu reference is only timed where it is cheap.
QUICK = [(1, 5, 32000, 512), (64, 5, 32000, 1024)]
FULL = [(R, k, V, ctx) for R in (1, 16, 64, 256) for k in (1, 3, 5, 8) for V in (32000, 128256)
        for ctx in ((512, 8192) if (k, V) == (5, 32000) else (2048,))]
CPU_LIMIT = 64 * 6 * 32000  # target-tensor elements (and R * ctx <= 64 * 2048) for timing the cpu reference


def bench_ops(reps: int, grid) -> list[str]:
    rows = [b for b in hal.list_backends() if b.available and not b.name.startswith("mutant")]
    skipped = [f"{b.name} ({b.validation})" for b in rows if "interpreter" in b.validation]
    names = [b.name for b in rows if "interpreter" not in b.validation]
    lines = ["### Ops per backend (median ms; `vs cpu` = cpu time / backend time, same inputs, one run)", ""]
    if skipped:
        lines += [f"Not timed (an interpreter, not a device): {', '.join(skipped)}.", ""]
    cols = [f"{n} ms" for n in names] + [f"{n} vs cpu" for n in names if n != "cpu"]
    lines += ["| op | shape | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for R, k, V, ctx in grid:
        with_cpu = R * (k + 1) * V <= CPU_LIMIT and R * ctx <= 64 * 2048
        cases = {n: op_cases(_backend(n), R, k, V, ctx) for n in names if n != "cpu" or with_cpu}
        for op in next(iter(cases.values())):
            t = timeit({n: c[op] for n, c in cases.items()}, reps)
            ms = " | ".join(f"{t[n] * 1e3:.3f}" if n in t else "—" for n in names)
            ratio = [f"{t['cpu'] / t[n]:.1f}x" if "cpu" in t else "—" for n in names if n != "cpu"]
            lines.append(f"| {op[0]} | R={R} k={k} V={V} ctx={ctx} {op[1]} | " + " | ".join([ms] + ratio) + " |")
    return lines


def bench_flashinfer(reps: int) -> list[str]:
    """cuda `verify_rejection` beside flashinfer.sampling.chain_speculative_sampling (GPU only)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001
        return [f"FlashInfer comparison skipped: flashinfer not importable ({type(e).__name__})."]
    if not any(b.name == "cuda" and b.available and "interpreter" not in b.validation for b in hal.list_backends()):
        return ["FlashInfer comparison skipped: no cuda backend on a device."]
    be = _backend("cuda")
    lines = ["### cuda `verify_rejection` vs FlashInfer `chain_speculative_sampling`", "",
             "| R | k | V | spec-hal ms | FlashInfer ms | ratio (FlashInfer / spec-hal) |", "|---:|---:|---:|---:|---:|---:|"]
    for R, k, V in [(1, 5, 32000), (64, 5, 32000), (256, 5, 128256)]:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(R, k, V, generator=g).softmax(-1).cuda()
        p = torch.randn(R, k + 1, V, generator=g).softmax(-1).cuda()
        ids = torch.randint(0, V, (R, k), generator=g).cuda()
        cu = (torch.arange(R + 1) * k).cuda()
        seeds, offsets = torch.arange(R).cuda(), torch.zeros(R, dtype=torch.long).cuda()
        ours = lambda: be.verify_rejection(ids.view(-1), cu, q.view(-1, V), p.view(-1, V), seeds, offsets, k)  # noqa
        try:
            theirs = lambda: flashinfer.sampling.chain_speculative_sampling(q, ids.int(), p)  # noqa: E731
            theirs()
        except Exception as e:  # noqa: BLE001
            return lines + [f"FlashInfer call failed: {type(e).__name__}: {e}"]
        t = timeit({"ours": ours, "fi": theirs}, reps)
        lines.append(f"| {R} | {k} | {V} | {t['ours'] * 1e3:.3f} | {t['fi'] * 1e3:.3f} | {t['fi'] / t['ours']:.2f}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/ops-cpu.md")
    ap.add_argument("--full", action="store_true", help="the whole R x k x V grid (meant for a GPU)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(torch.get_num_threads())
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    cmd = "python benchmarks/ops.py " + " ".join(a for a in __import__("sys").argv[1:] if a != "--out")
    header = ["# spec-hal op benchmarks", "",
              f"Command: `{cmd.strip()}`; {dev}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
              f"{time.strftime('%Y-%m-%d')}.", ""]
    body = ([] if args.no_hf else bench_vs_hf(args.reps) + [""] + bench_from_logits(args.reps) + [""]) + bench_ops(args.reps, FULL if args.full else QUICK)
    body += [""] + bench_flashinfer(args.reps)
    text = "\n".join(header + body) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
