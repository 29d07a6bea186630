"""What a draft tree costs here: the target's verify of N drafts as a chain and as a tree
(mask, depths, the invariant runner's chain-order gathers), and the EAGLE head's drafting of
N tokens as a chain and as an EAGLE-2 tree (`hal.drafters.kinds.TREE`), against one decode, all
interleaved in one run (medians). SmolLM2-135M (GGUF) with its shipped head, or random weights
of the same shapes (``--random``: no download; what the GPU check uses). Writes
benchmarks/results/trees-<backend>.md.

    python benchmarks/trees.py [--backend cpu] [--random] [--nodes 3,7,15,30] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import hal
from hal.models.machine import machine_line
from hal.engine import trees
from hal.drafters.eagle import EagleDrafter
from hal.drafters.kinds import TREE
from hal.engine.forward import forward, forward_tokens
from hal.kv import KVPool
from hal.engine.drafting import DraftBatch
from hal.engine.requests import Request

CTX = 200


def models(be, dev, random: bool):
    if random:   # SmolLM2-135M's shapes; an untrained EAGLE-1 head over an 8192-token draft vocabulary
        from hal.models.eagle import EagleConfig, EagleModel
        from hal.models.llama import random_llama
        target = random_llama(576, 30, 9, 3, 64, 1536, 49152, seed=0, scale=0.02, backend=be.name).to(dev)
        g = torch.Generator().manual_seed(1)
        w = {"fc": torch.randn(576, 1152, generator=g) * 0.02, "wqkv": torch.randn(960, 576, generator=g) * 0.02,
             "wo": torch.randn(576, 576, generator=g) * 0.02, "wgu": torch.randn(3072, 576, generator=g) * 0.02,
             "wdown": torch.randn(576, 1536, generator=g) * 0.02, "ffn_norm": torch.ones(576),
             "draft_ids": torch.arange(8192)}
        cfg = EagleConfig(version=1, hidden=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, eps=1e-5,
                          rope_base=100000.0, draft_vocab=8192)
        return target, EagleModel(cfg, w, target)
    from hal.models.eagle import shipped_head
    from hal.models.eagle_layouts import load_eagle
    from hal.models.fetch import fetch
    from hal.models.loaders import load_gguf
    target = load_gguf(fetch("smollm2-135m"), be, "auto")[0].to(dev)
    return target, load_eagle(shipped_head("smollm2-135m"), target)


def verify(target, n: int, tree: bool):
    """One target forward over [root, n drafts] after CTX cached tokens: a chain, or a tree
    (two children of the root, then a chain under the second: depth about n/2)."""
    cfg, dev = target.cfg, target.device
    pool = KVPool(target.be, 64, 16, cfg.kv_heads, cfg.head_dim, dtype=target.dtype, num_layers=cfg.layers, device=dev)
    seq = pool.sequence()
    forward(target, pool, [seq], [list(range(10, 10 + CTX))], False)
    seq.commit(CTX)
    tokens = torch.arange(100, 101 + n).to(dev)
    if not tree:
        return lambda: forward_tokens(target, pool, [seq], [n + 1], tokens, all_rows=True)
    parents = torch.tensor(([-1, -1] + list(range(n - 2)))[:n]).to(dev)

    def run():
        depth, mask = trees.layout(parents, [n], [], dev)
        forward_tokens(target, pool, [seq], [n + 1], tokens, all_rows=True, tree_mask=mask, depth=depth)
    return run


def draft(target, head, n: int, tree: bool):
    """The head drafting n tokens (a chain) or an n-node tree for one request of CTX tokens."""
    d, dev = EagleDrafter(head, tree=TREE if tree else None), target.device
    feats = torch.zeros(CTX - 1, target.cfg.hidden, device=dev)
    hist = torch.arange(10, 10 + CTX)[None].to(dev)
    common = dict(rids=(0,), params=(Request([1]),), history=hist, num_tokens=torch.tensor([CTX], device=dev),
                  lengths=(CTX,), k=(n,), offsets=(0,))
    first = DraftBatch(**common, features=feats, num_features=(CTX - 1,))
    d.propose(first)      # the history's features go in once; each timed call re-feeds the newest pair
    again = DraftBatch(**common, num_features=(0,))
    return lambda: d.propose(again)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--random", action="store_true", help="random weights of the same shapes (no download)")
    ap.add_argument("--nodes", default="3,7,15,30", help="draft counts (a top-3 depth-4 head tree has at most 30 nodes)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    be = hal.get_backend(args.backend)
    dev = torch.device(be.device_type)
    nodes = [int(x) for x in args.nodes.split(",")]
    with torch.inference_mode():
        target, head = models(be, dev, args.random)
        cases = {("decode", 0): verify(target, 0, False)}
        for n in nodes:
            cases |= {("chain", n): verify(target, n, False), ("tree", n): verify(target, n, True),
                      ("head chain", n): draft(target, head, n, False), ("head tree", n): draft(target, head, n, True)}
        times = {c: [] for c in cases}
        for f in cases.values():
            f()                                   # warm up
        for _ in range(args.reps):               # interleaved: every case once per round
            for c, f in cases.items():
                be.synchronize()
                t = time.perf_counter()
                f()
                be.synchronize()
                times[c].append(time.perf_counter() - t)
    ms = {c: statistics.median(v) * 1e3 for c, v in times.items()}
    d1 = ms[("decode", 0)]
    weights = "random weights, SmolLM2-135M shapes" if args.random else "SmolLM2-135M GGUF, the shipped head"
    lines = [f"# Draft trees: verify and drafting cost ({weights}, backend {args.backend})", "",
             f"Command: `python benchmarks/trees.py --backend {args.backend}{' --random' if args.random else ''} "
             f"--nodes {args.nodes} --reps {args.reps}`; torch {torch.__version__}, {args.threads} threads, "
             f"{CTX} cached tokens, medians of {args.reps} interleaved rounds, {time.strftime('%Y-%m-%d')}; "
             f"{machine_line(getattr(target, 'plan', None))}.", "",
             f"One-token decode: {d1:.1f} ms. Head tree: top-{TREE[0]}, depth {TREE[1]}.", "",
             "| drafts N | chain verify ms | / decode | tree verify ms | / decode | head chain of N ms | "
             "head tree of N ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in nodes:
        lines.append(f"| {n} | {ms[('chain', n)]:.1f} | {ms[('chain', n)] / d1:.2f} | {ms[('tree', n)]:.1f} | "
                     f"{ms[('tree', n)] / d1:.2f} | {ms[('head chain', n)]:.1f} | {ms[('head tree', n)]:.1f} |")
    out = Path(args.out or f"benchmarks/results/trees-{args.backend}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
