"""End-to-end greedy generation on SmolLM2-135M (GGUF), side by side in one run:
spec-hal plain and speculative decoding (each drafter) against HF transformers
``generate()`` plain and with ``prompt_lookup_num_tokens``. Same input ids, same
thread count, greedy. Writes a markdown table and a PNG under benchmarks/results/.

    python benchmarks/e2e.py [--max-new-tokens 96] [--k 5] [--eagle-k 4] [--tree-k 7] [--no-hf]

Draft trees: EAGLE-2 dynamic trees from the shipped head (`hal.drafters.kinds.TREE`) and n-gram
tries, ``--tree-k`` nodes (fixed) or routed up to that many.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hal
from hal.engine import Request, SpeculativeDecoder
from hal.drafters import ModelDrafter, NgramDrafter, NgramTreeDrafter
from hal.drafters.kinds import TREE
from hal.models.fetch import fetch
from hal.models.machine import machine_line
from hal.models.loaders import load_gguf
from hal.models.tokenizer import chatml

PASSAGE = ("The committee met on Tuesday to review the annual budget. After a long discussion, the members agreed "
           "to increase funding for the public library by ten percent, to repair the bridge on Mill Street before "
           "winter, and to postpone the new parking garage until next year. The mayor thanked the volunteers who "
           "organised the spring festival and asked the committee to prepare a report on school transport.")
CODE = ("def parse_line(line):\n    parts = line.strip().split(',')\n    name = parts[0]\n    age = int(parts[1])\n"
        "    city = parts[2]\n    return {'name': name, 'age': age, 'city': city}\n\n"
        "def parse_file(path):\n    with open(path) as f:\n        return [parse_line(l) for l in f if l.strip()]")
PROMPTS = [
    ("copy: summarise", "copy", f"Summarise this text, reusing its words:\n\n{PASSAGE}"),
    ("copy: repeat", "copy", f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"),
    ("copy: edit code", "copy", f"Rename the variable `parts` to `fields` in this code and output the whole code:\n\n{CODE}"),
    ("open: chat", "open", "What are some fun things to do on a rainy weekend?"),
]


K_PROMPT = 2  # the speedup-against-k sweep runs on the copy prompt "edit code"


def run_ours(target, drafter, ids, n, k, costs=None):
    dec = SpeculativeDecoder(target, drafter, num_blocks=256)
    if costs is not None:
        from hal.engine.router import Router
        dec.router = Router(costs, max_k=k)
    t = time.perf_counter()
    out = dec.generate([Request(ids, max_new_tokens=n, k=k, stop_ids=(2,))])[0]
    target.be.synchronize()
    return out, time.perf_counter() - t, dec.metrics


def run_hf(model, ids, n, k=None):
    x = torch.tensor([ids])
    kw = dict(prompt_lookup_num_tokens=k) if k else {}
    t = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=2,
                         pad_token_id=2, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def forward_cost(target, n_tokens, ctx=200, reps=7, tree=False):
    """Seconds of one target forward over n_tokens new tokens after ctx cached ones (``tree``:
    as a draft tree of n_tokens - 1 nodes, two branches, with its mask and depths)."""
    from hal.engine import trees
    from hal.engine.forward import forward
    from hal.engine.forward import forward_tokens
    from hal.kv import KVPool
    cfg = target.cfg
    pool = KVPool(target.be, 64, 16, cfg.kv_heads, cfg.head_dim, dtype=target.dtype, num_layers=cfg.layers)
    seq = pool.sequence()
    forward(target, pool, [seq], [list(range(10, 10 + ctx))], False)
    seq.commit(ctx)
    times = []
    for _ in range(reps):
        target.be.synchronize()
        t = time.perf_counter()
        if tree:
            parents = torch.tensor([-1, -1] + list(range(n_tokens - 3)))[:n_tokens - 1]
            depth, mask = trees.layout(parents, [n_tokens - 1], [], torch.device(target.be.device_type))
            forward_tokens(target, pool, [seq], [n_tokens], torch.arange(100, 100 + n_tokens), True, mask,
                           depth=depth)
        else:
            forward(target, pool, [seq], [list(range(100, 100 + n_tokens))], True)
        target.be.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--self-layers", type=int, default=20)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--head", help="an EAGLE head folder (default: the one shipped for the model)")
    ap.add_argument("--eagle-k", type=int, default=4, help="chain length of the fixed-k EAGLE rows")
    ap.add_argument("--tree-k", type=int, default=7, help="nodes of the fixed-size draft trees (the routed cap)")
    ap.add_argument("--heldout", type=int, default=8, help="held-out prompts for the head's acceptance table")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the target's linear plan dtype (auto: measured here)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    n, k = args.max_new_tokens, args.k
    path = fetch("smollm2-135m")
    be = hal.get_backend("cpu")
    target, tok = load_gguf(path, be, args.dtype)
    args.machine = machine_line(target.plan)
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
        hf.eval()
    systems = [("spec-hal plain", lambda ids: run_ours(target, None, ids, n, 0)),
               (f"spec-hal ngram k={k}", lambda ids: run_ours(target, NgramDrafter(be), ids, n, k)),
               (f"spec-hal self-spec L={args.self_layers} k=3",
                lambda ids: run_ours(target, ModelDrafter(target.layer_view(args.self_layers)), ids, n, 3))]
    from hal.models.eagle import shipped_head
    from hal.models.eagle_layouts import load_eagle
    from hal.drafters.eagle import EagleDrafter, NgramOrHead
    head = load_eagle(args.head or shipped_head("smollm2-135m"), target)
    ek, tk = args.eagle_k, args.tree_k
    eagle = lambda: EagleDrafter(head)  # noqa: E731
    both = lambda: NgramOrHead(NgramDrafter(be, min_n=2), EagleDrafter(head))  # noqa: E731
    tree = lambda: EagleDrafter(head, tree=TREE)  # noqa: E731
    both_tree = lambda: NgramOrHead(NgramDrafter(be, min_n=2), EagleDrafter(head, tree=TREE))  # noqa: E731
    with torch.inference_mode():   # cost tables for the routers (and the Leviathan bound), measured here
        costs = {name: SpeculativeDecoder(target, make(), num_blocks=256).profile_costs(max_tokens=17, context=200)
                 for name, make in (("eagle", eagle), ("both", both), ("tree", tree), ("both-tree", both_tree))}
    systems += [(f"spec-hal eagle k={ek}", lambda ids: run_ours(target, eagle(), ids, n, ek)),
                (f"spec-hal eagle routed k<={k + 2}", lambda ids: run_ours(target, eagle(), ids, n, k + 2, costs["eagle"])),
                (f"spec-hal ngram+eagle routed k<={k + 2}",
                 lambda ids: run_ours(target, both(), ids, n, k + 2, costs["both"])),
                (f"spec-hal ngram-tree k={tk}", lambda ids: run_ours(target, NgramTreeDrafter(be), ids, n, tk)),
                (f"spec-hal eagle-tree k={tk}", lambda ids: run_ours(target, tree(), ids, n, tk)),
                (f"spec-hal eagle-tree routed k<={tk}", lambda ids: run_ours(target, tree(), ids, n, tk, costs["tree"])),
                (f"spec-hal ngram+eagle-tree routed k<={tk}",
                 lambda ids: run_ours(target, both_tree(), ids, n, tk, costs["both-tree"]))]
    if hf is not None:
        systems += [("HF generate plain", lambda ids: (*run_hf(hf, ids, n), None)),
                    (f"HF prompt lookup k={k}", lambda ids: (*run_hf(hf, ids, n, k), None))]
    rows, accept_pos = [], None
    with torch.inference_mode():
        for label, kind, prompt in PROMPTS:
            ids = tok.encode(chatml(prompt)).ids
            res = {name: f(ids) for name, f in systems}
            base = res["spec-hal plain"][0]
            for name, (out, dt, m) in res.items():
                rows.append(dict(prompt=label, kind=kind, system=name, tokens=len(out), tps=len(out) / dt,
                                 acc=m.acceptance_rate if m and m.total.num_drafts else None,
                                 mal=m.mean_acceptance_length if m and m.total.num_drafts else None,
                                 same=out == base))
                if name == f"spec-hal ngram k={k}" and kind == "copy":
                    accept_pos = m.total if accept_pos is None else _merge(accept_pos, m.total)
        # speedup against k, n-gram drafter, copy-heavy prompts
        ks, speedups = [1, 2, 3, 5, 8], []
        copy_ids = [tok.encode(chatml(p)).ids for _, kind, p in PROMPTS if kind == "copy"]
        plain_t = run_ours(target, None, copy_ids[K_PROMPT], n, 0)
        for kk in ks:
            o, dt, _ = run_ours(target, NgramDrafter(be), copy_ids[K_PROMPT], n, kk)
            speedups.append((len(o) / dt) / (len(plain_t[0]) / plain_t[1]))
        c1, ck = forward_cost(target, 1), forward_cost(target, k + 1)
        cek, ctk = forward_cost(target, ek + 1), forward_cost(target, tk + 1, tree=True)
        # the head on prompts it never saw (held-out topics): acceptance and speed, chain k
        from hal.training import data as eagle_data
        held = eagle_data.prompts(heldout=True)[:args.heldout]
        held_tot, held_t, plain_t_sum, held_same = {}, {}, 0.0, True
        for p in held:
            ids = tok.encode(chatml(p)).ids
            po, pt, _ = run_ours(target, None, ids, n, 0)
            plain_t_sum += pt
            for name, make, kk in (("chain", eagle, ek), ("tree", tree, tk)):
                eo, et, m = run_ours(target, make(), ids, n, kk)
                held_tot[name] = m.total if name not in held_tot else _merge(held_tot[name], m.total)
                held_t[name] = held_t.get(name, 0.0) + et * len(po) / max(1, len(eo))
                held_same &= eo == po
    draft_k, draft_t = costs["eagle"].draft, costs["tree"].draft
    heldout = dict(n=len(held), same=held_same)
    for name, ct, dt, kk in (("chain", cek, draft_k, ek), ("tree", ctk, draft_t, tk)):
        tot = held_tot[name]
        heldout[name] = dict(tau=tot.mean_acceptance_length, acc=tot.acceptance_rate,
                             pos=tot.acceptance_by_position(), speedup=plain_t_sum / held_t[name],
                             bound=tot.mean_acceptance_length * c1 / (ct + _interp_draft(dt, kk)))
    write(args, rows, accept_pos, ks, speedups, c1, ck, k, hf is not None,
          dict(ek=ek, cek=cek, draft=draft_k, tk=tk, ctk=ctk, draft_tree=draft_t, heldout=heldout))


def _interp_draft(table, k):
    from hal.engine.costs import interpolate
    return interpolate(table, k) if table else 0.0


def _merge(a, b):
    from hal.metrics import Counters
    out = Counters()
    for c in (a, b):
        out.num_drafts += c.num_drafts
        out.num_draft_tokens += c.num_draft_tokens
        out.num_accepted_tokens += c.num_accepted_tokens
        for name in ("accepted_per_position", "drafts_per_position"):
            x, y = getattr(out, name), getattr(c, name)
            x.extend([0] * (len(y) - len(x)))
            for j, v in enumerate(y):
                x[j] += v
    return out


def fmt(x) -> str:
    return "" if x is None else f"{x:.2f}"


def write(args, rows, accept_pos, ks, speedups, c1, ck, k, with_hf, eg):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by = {}
    for r in rows:
        by.setdefault(r["prompt"], {})[r["system"]] = r
    lines = ["# spec-hal end-to-end benchmark (SmolLM2-135M-Instruct, GGUF Q4_1, greedy)", "",
             f"Command: `python benchmarks/e2e.py --max-new-tokens {args.max_new_tokens} --k {k} --eagle-k "
             f"{eg['ek']} --tree-k {eg['tk']} --dtype {args.dtype}`; "
             f"2 threads, {time.strftime('%Y-%m-%d')}. All systems in one run, same input ids; HF transformers in "
             f"fp32. {args.machine}.",
             "", "| prompt | system | tokens | tok/s | vs spec-hal plain | vs HF plain | vs HF prompt lookup | "
             "acceptance | mean acc. length | same as plain greedy | Leviathan efficiency |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for prompt, sysrows in by.items():
        plain = sysrows["spec-hal plain"]["tps"]
        hf_plain = sysrows.get("HF generate plain", {}).get("tps")
        hf_pld = sysrows.get(f"HF prompt lookup k={k}", {}).get("tps")
        for name, r in sysrows.items():
            eff = ""
            if r["mal"] is not None and name.startswith(f"spec-hal ngram k={k}"):
                bound = r["mal"] * c1 / ck    # tau * cost_1 / cost_{k+1}, n-gram drafting ~free
                eff = f"{(r['tps'] / plain) / bound:.2f}"
            if r["mal"] is not None and name == f"spec-hal eagle k={eg['ek']}":   # + the head's chain
                bound = r["mal"] * c1 / (eg["cek"] + _interp_draft(eg["draft"], eg["ek"]))
                eff = f"{(r['tps'] / plain) / bound:.2f}"
            if r["mal"] is not None and name == f"spec-hal eagle-tree k={eg['tk']}":   # + the head's tree
                bound = r["mal"] * c1 / (eg["ctk"] + _interp_draft(eg["draft_tree"], eg["tk"]))
                eff = f"{(r['tps'] / plain) / bound:.2f}"
            f = lambda x: f"{r['tps'] / x:.2f}x" if x else "—"  # noqa: E731
            lines.append(f"| {prompt} | {name} | {r['tokens']} | {r['tps']:.1f} | {r['tps'] / plain:.2f}x | "
                         f"{f(hf_plain)} | {f(hf_pld)} | {fmt(r['acc'])} | "
                         f"{fmt(r['mal'])} | "
                         f"{'yes' if r['same'] else 'no'} | {eff} |")
    lines += ["", f"Target forward cost: 1 token {c1 * 1e3:.1f} ms, {k + 1} tokens {ck * 1e3:.1f} ms "
              f"(ratio {ck / c1:.2f}), {eg['ek'] + 1} tokens {eg['cek'] * 1e3:.1f} ms; the head's chain of "
              f"{eg['ek']} drafts {_interp_draft(eg['draft'], eg['ek']) * 1e3:.1f} ms. Leviathan efficiency = "
              f"measured speedup / (tau * cost_1 / (cost_(k+1) + draft chain))."
              f" A {eg['tk']}-node tree verify (mask, depths) {eg['ctk'] * 1e3:.1f} ms; the head's tree of "
              f"{eg['tk']} {_interp_draft(eg['draft_tree'], eg['tk']) * 1e3:.1f} ms (top-{TREE[0]}, depth {TREE[1]}).",
              "", f"EAGLE head on {eg['heldout']['n']} held-out prompts (topics never trained on); outputs "
              f"{'identical' if eg['heldout']['same'] else 'DIFFERENT'} to plain greedy:", ""] + [
              f"- {what}: mean acceptance length tau {h['tau']:.2f}, acceptance {h['acc']:.2f}, by position " +
              ", ".join(f"{p:.2f}" for p in h['pos']) + f"; speedup vs plain {h['speedup']:.2f}x (bound "
              f"{h['bound']:.2f}x, efficiency {h['speedup'] / h['bound']:.2f})"
              for what, h in ((f"chain k={eg['ek']}", eg['heldout']['chain']),
                              (f"tree k={eg['tk']} (top-{TREE[0]}, depth {TREE[1]})", eg['heldout']['tree']))] + [
              "", "Speedup of n-gram speculative decoding against k (copy prompt 'edit code'): " +
              ", ".join(f"k={a}: {b:.2f}x" for a, b in zip(ks, speedups)), ""]
    if accept_pos is not None:
        lines.append("Acceptance by position (n-gram, copy-heavy prompts): " +
                     ", ".join(f"{p:.2f}" for p in accept_pos.acceptance_by_position()))
    (out / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        if accept_pos is not None:
            acc = accept_pos.acceptance_by_position()
            ax[0].bar(range(1, len(acc) + 1), acc)
        ax[0].set(title="n-gram acceptance by draft position (copy-heavy)", xlabel="position", ylabel="P(accepted)")
        ax[1].plot(ks, speedups, marker="o")
        ax[1].axhline(1.0, color="gray", lw=0.5)
        ax[1].set(title="speedup vs plain against k (n-gram, 'edit code')", xlabel="k", ylabel="speedup")
        fig.tight_layout()
        fig.savefig(out / "e2e.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no PNG")


if __name__ == "__main__":
    main()
