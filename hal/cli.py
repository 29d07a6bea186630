"""``python -m hal`` / ``spec-hal``: info, conformance, demo, model, generate, bench, train-head."""

from __future__ import annotations

import argparse
import os
import sys

from hal.drafters.kinds import draft_help, draft_kinds
from hal.errors import HalError
from hal.launch.build import cli_drafter
from hal.launch.flags import add_dtype_args, bounded, model_flag
from hal.training.command import add_train_head, cmd_train_head
from hal.models.fetch import load_model


def cmd_info(_args) -> int:
    from hal import list_backends
    rows = [("backend", "available", "device", "block sizes", "head_dim %", "validation")]
    for b in list_backends():
        avail = "yes" if b.available else f"no: {b.reason}"
        rows.append((b.name, avail, b.device_type, b.block_sizes, str(b.head_dim_align), b.validation))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sel = os.environ.get("HAL_BACKEND", "auto")
    print(f"\nHAL_BACKEND={sel}")
    if os.environ.get("HAL_PLACEMENT"):
        from hal.distributed.placement import Placement, link_backend
        p = Placement.from_env()
        try:
            d, t = p.resolve()
            where = f"draft -> {d.backend.name} on {d.device}, target -> {t.backend.name} on {t.device}"
        except HalError as e:
            where = f"unresolvable here: {e}"
        print(f"HAL_PLACEMENT={os.environ['HAL_PLACEMENT']}: {where}; link {link_backend(p)}")
    print_plan("smollm2-135m", getattr(_args, "dtype", "auto"), getattr(_args, "plan_refresh", False),
               getattr(_args, "lm_head", "auto"))
    return 0


def print_plan(model: str, dtype: str, refresh: bool, lm_head: str = "auto") -> None:
    """The linear plan the runner uses for ``model``'s shapes on this machine (measured once, then
    cached), its lm_head's form as ``lm_head`` (``--lm-head``) pins it."""
    from hal.models.fetch import MODEL_SHAPES, MODEL_INT4, MODEL_Q8_HEAD
    from hal.models.linear_plan import choose_plan, pin_head
    from hal.models.machine import cpu_signature
    from hal.models.llama import LINEAR_KEYS, LlamaConfig, linear_shapes
    if model not in MODEL_SHAPES:
        return
    sig = cpu_signature()
    print(f"\nCPU: {sig['cpu']}, {sig['cores']} cores, {sig['threads']} threads, torch {sig['torch']}; "
          f"flags {' '.join(sig['flags']) or 'none'}")
    print(f"linear plan for {model} (--dtype {dtype}; measured once per machine, cached under $HAL_CACHE/plans):",
          flush=True)
    cfg = LlamaConfig(**MODEL_SHAPES[model], rope_base=1e4, eps=1e-5, rope_interleaved=True)
    int4 = [name in MODEL_INT4[model] for _ in range(cfg.layers) for name in LINEAR_KEYS] + [False]
    choice = choose_plan(linear_shapes(cfg), dtype, refresh=refresh, stored_int4=int4, q8_head=model in MODEL_Q8_HEAD)
    print(f"  {choice.plan.describe()} ({'cached' if choice.from_cache else 'measured now'}; {choice.conditions()})")
    try:
        head = pin_head(choice, lm_head)
        if lm_head != "auto":
            print(f"  --lm-head {lm_head}: {head.describe()}")
    except HalError as e:
        head = choice.plan
        print(f"  {e}")
    for c in sorted(choice.candidates, key=lambda c: c["score"]):
        ms = ", ".join(f"M={m}: {t:.1f}" for m, t in c["ms"].items())
        ms = f"{ms} ms" if ms else "predicted from single chunks; not timed"
        plan = c["plan"]
        print(f"    {plan['dtype']:9s} {plan.get('weights', 'float'):5s} {plan['layout']:6s} widths "
              f"{'/'.join(map(str, plan['widths'])):11s}"
              f" score {c['score']:7.1f} ms  ({ms})")
    for h in choice.heads:   # the lm_head's forms, timed alone at the winner's widths
        ms = ", ".join(f"M={m}: {t:.1f}" for m, t in h["ms"].items())
        print(f"    lm_head {h['head']:5s} {'(chosen)' if h['head'] == head.head else '':8s}"
              f"                score {h['score']:7.1f} ms  ({ms} ms)")
    for why in choice.rejected[:8]:   # widths the self-check dropped, families not measured, and why
        print(f"    not used: {why}")
    if len(choice.rejected) > 8:
        print(f"    not used: {len(choice.rejected) - 8} more")


def cmd_conformance(args, extra: list[str]) -> int:
    import pytest
    if args.plugin:
        os.environ["HAL_PLUGINS"] = ",".join(filter(None, [os.environ.get("HAL_PLUGINS", ""), *args.plugin]))
    import hal
    try:
        hal.get_backend(args.backend)  # fail fast, with the registry's explanation
    except hal.HalError as e:
        print(f"conformance: {e}", file=sys.stderr)
        return 2
    from importlib.metadata import entry_points
    installed = any(ep.value == "hal.conformance.plugin" for ep in entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "hal.conformance.plugin"]  # running from a source tree
    if args.fuzz is not None:
        from hal.ops import OP_NAMES
        if args.fuzz < 1:
            print(f"conformance: --fuzz: expected a number of cases >= 1, got {args.fuzz}", file=sys.stderr)
            return 2
        os.environ["HAL_FUZZ_EXAMPLES"] = str(-(-args.fuzz // (3 * len(OP_NAMES))))
        extra = ["-k", "test_fuzz", *extra]
    if args.slow:
        os.environ["HAL_SLOW"] = "1"
    return int(pytest.main(["--pyargs", "hal.conformance", "--hal-backend", args.backend, *plugin,
                            "-p", "no:cacheprovider", "-q",
                            "-W", "ignore::pytest.PytestAssertRewriteWarning", *extra]))


DEMO_PROMPTS = [
    ("copy-heavy", "Fix the typo in this code and repeat it in full:\n"
                   "def mean(values):\n    total = sum(values)\n    return totl / len(values)\n\n"
                   "def variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)"),
    ("open-ended", "Give me three tips for a good night's sleep."),
]


def _load(name: str, backend, args):
    """(model, tokenizer, chat template) of ``name`` (a fetchable name, a GGUF or an HF folder);
    `HalError` if it has no tokenizer (the CLI takes text)."""
    from hal.models.fetch import model_path
    from hal.models.tokenizer import chat_template_of
    model, tok = load_model(name, backend, args.dtype, plan_refresh=args.plan_refresh, lm_head=args.lm_head,
                            row_codes=args.row_codes)
    if tok is None:
        raise HalError(f"--model: expected a model with a tokenizer (a GGUF, or an HF folder with tokenizer.json), "
                       f"got {name}", arg="--model")
    return model, tok, chat_template_of(model_path(name))


DEMO_REPS = 5   # each run of the demo is timed this many times, interleaved; the least time counts


def cmd_demo(args) -> int:
    """The main job: a real model, speculative vs plain decoding, on built-in prompts (each
    timed `DEMO_REPS` times, interleaved: a busy spell of a shared machine only adds time)."""
    import hal
    if args.ops:
        return demo_ops()
    be = hal.get_backend()
    try:
        model, tok, template = _load("smollm2-135m", be, args)
    except HalError as e:
        print(f"demo: the model could not be fetched ({e}); showing one verify round instead", file=sys.stderr)
        return demo_ops()
    print(f"model smollm2-135m (SmolLM2-135M-Instruct, GGUF Q4_1), backend {be.name}, greedy; "
          f"linear plan {model.plan.describe()}")
    drafts = {"ngram+eagle": "n-gram lookup where it matches, else the EAGLE head",
              "ngram+dspark": "n-gram lookup where it matches, else the DSpark block drafter"}
    costs = {d: measured_costs(model, cli_drafter(d, model, be), max_tokens=9) for d in drafts}
    print("cost table profiled: " + ", ".join(f"{t} tok {c * 1e3:.0f} ms"
                                              for t, c in sorted(costs["ngram+eagle"].verify.items())) + "\n")
    for label, prompt in DEMO_PROMPTS:
        print(f"=== {label} prompt ===\n{prompt}\n")
        runs = {}
        for draft, what in drafts.items():
            print(f"--- speculative ({what}; k <= 6 chosen per step by the router) ---")
            runs[draft] = list(run_generate(model, tok, prompt, draft, 6, 0.0, 96, 0, costs=costs[draft],
                                            template=template)[1:])
        print("--- plain decoding ---")
        _, plain, tp, _ = run_generate(model, tok, prompt, "none", 0, 0.0, 96, 0, template=template)
        for _ in range(DEMO_REPS - 1):   # timed again, interleaved: each keeps its least time
            tp = min(tp, run_generate(model, tok, prompt, "none", 0, 0.0, 96, 0, False, template=template)[2])
            for draft in drafts:
                runs[draft][1] = min(runs[draft][1], run_generate(model, tok, prompt, draft, 6, 0.0, 96, 0, False,
                                                                  costs=costs[draft], template=template)[2])
        for draft, (spec, ts, m) in runs.items():
            print(f"\n[{label}] {draft}: speculative {len(spec) / ts:.1f} tok/s, plain {len(plain) / tp:.1f} tok/s, "
                  f"speedup {len(spec) / ts / (len(plain) / tp):.2f}x; acceptance rate {m.acceptance_rate:.2f}, "
                  f"mean acceptance length {m.mean_acceptance_length:.2f}; "
                  f"outputs {'identical' if spec == plain else 'DIFFERENT'}")
        print()
    return 0


def demo_ops() -> int:
    """One readable verify round on the selected backend."""
    import torch

    import hal
    be = hal.get_backend()
    vocab = ["<s>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    # Two requests. The target agrees with "the cat" but wants "on" where the draft says
    # "sat"; it agrees with all of "a dog" and adds a bonus token.
    target_tokens = [[1, 2, 4, 4, 5], [6, 7, 3]]    # target argmax per row (k + 1 rows each)
    drafts = [[1, 2, 3, 4], [6, 7]]
    ids = torch.tensor([t for d in drafts for t in d])
    cu = torch.tensor([0, 4, 6])
    logits = torch.full((sum(map(len, target_tokens)), len(vocab)), -5.0)
    logits[torch.arange(logits.shape[0]), torch.tensor([t for r in target_tokens for t in r])] = 5.0
    dev = be.device_type
    out, n = be.verify_greedy(ids.to(dev), cu.to(dev), logits.to(dev), 4)
    print(f"backend: {be.name}")
    for r, d in enumerate(drafts):
        row = [vocab[t] for t in out[r].tolist() if t >= 0]
        print(f"request {r}: drafts {[vocab[t] for t in d]!s:<34} target argmax {[vocab[t] for t in target_tokens[r]]}")
        print(f"           accepted {int(n[r])}/{len(d)} -> emits {row}")
    seeds, offsets = torch.tensor([1, 2]), torch.tensor([0, 0])
    probs = torch.softmax(logits / 2.0, -1)
    out, n = be.verify_rejection(ids.to(dev), cu.to(dev), None, probs.to(dev), seeds.to(dev), offsets.to(dev), 4)
    print("rejection sampling (T=2, n-gram style drafts):",
          [[vocab[t] for t in row if t >= 0] for row in out.tolist()], "accepted", n.tolist())
    return 0


def cmd_model(args) -> int:
    if args.model_cmd == "export-drafter":
        import hal
        from hal.models.export import export_drafter
        print(export_drafter(args.kind, args.model, args.out, hal.get_backend()))
        return 0
    from hal.models.fetch import fetch
    print(fetch(args.name))
    return 0


def measured_costs(model, drafter, max_tokens: int):
    """The router's costs for ``drafter`` over ``model``, measured once before anything is
    timed and shared by the engines of one command (`hal.engine.costs.profile_costs`)."""
    from hal.engine.memory import target_pool
    from hal.engine.costs import profile_costs
    return profile_costs(model, drafter, target_pool(model, 64), max_tokens=max_tokens, context=128, reps=3)


def run_generate(model, tok, prompt: str, draft: str, k: int, temperature: float, max_tokens: int, seed: int,
                 stream: bool = True, costs=None, model_name: str = "smollm2-135m", template=None):
    """One request: ``prompt`` as one user turn of the model's chat ``template`` (None: as it is,
    `hal.models.tokenizer.prompt_ids`); returns (text, tokens, seconds, metrics). With ``costs``
    (a `hal.engine.costs.CostModel`) a router picks k <= ``k`` per step."""
    import time

    from hal.engine import Request
    from hal.launch.build import build_engine, local_pool
    from hal.models.tokenizer import prompt_ids
    ids = prompt_ids(tok, template, prompt)
    shown = []

    def show(_rid, new):  # stream: print the text that the new tokens complete
        before = tok.decode(shown, skip_special_tokens=True)
        shown.extend(new)
        print(tok.decode(shown, skip_special_tokens=True)[len(before):], end="", flush=True)

    dec = build_engine(model, cli_drafter(draft, model, model.be, model_name), k=k, route=costs is not None,
                       costs=costs, pool=local_pool(model, 1, len(ids) + max_tokens, k),
                       on_tokens=show if stream else None)
    req = Request(ids, max_new_tokens=max_tokens, temperature=temperature, seed=seed, k=k if draft != "none" else 0,
                  stop_ids=model.cfg.stop_ids)
    t = time.perf_counter()
    out = dec.generate([req])[0]
    dt = time.perf_counter() - t
    if stream:
        print(flush=True)
    return tok.decode(out, skip_special_tokens=True), out, dt, dec.metrics


def cmd_bench(args) -> int:
    """Routed speculative decoding on the demo prompts as one batch; a summary, then the
    metrics in Prometheus text format."""
    import time

    import hal
    from hal.engine import Request
    from hal.launch.build import build_engine, local_pool
    from hal.metrics import percentile, prometheus_text, require_prometheus
    from hal.models.tokenizer import prompt_ids
    require_prometheus()  # fail before loading anything
    be = hal.get_backend()
    model, tok, template = _load(args.model, be, args)
    reqs = [Request(prompt_ids(tok, template, p), max_new_tokens=args.max_tokens, k=args.k,
                    stop_ids=model.cfg.stop_ids) for _ in range(args.batch) for _, p in DEMO_PROMPTS]
    pool = local_pool(model, len(reqs), max(len(r.prompt_ids) for r in reqs) + args.max_tokens, args.k)
    dec = build_engine(model, cli_drafter(args.draft, model, be, args.model), k=args.k, route=not args.fixed_k,
                       pool=pool, profile={"max_tokens": (args.k + 1) * len(reqs)})
    t = time.perf_counter()
    outs = dec.generate(reqs)
    dt = time.perf_counter() - t
    m = dec.metrics
    n = sum(map(len, outs))
    print(f"# {len(reqs)} requests, draft {args.draft}, {'fixed k=' if args.fixed_k else 'routed k<='}{args.k}, "
          f"backend {be.name}: {n} tokens in {dt:.2f}s = {n / dt:.1f} tok/s; acceptance {m.acceptance_rate:.2f}, "
          f"mean acceptance length {m.mean_acceptance_length:.2f}; TTFT P50 {percentile(m.ttft, 50) * 1e3:.0f} ms, "
          f"TPOT P50 {percentile(m.tpot, 50) * 1e3:.1f} ms, P99 {percentile(m.tpot, 99) * 1e3:.1f} ms")
    print(prometheus_text(m), end="")
    return 0


def cmd_generate(args) -> int:
    import hal
    be = hal.get_backend()
    model, tok, template = _load(args.model, be, args)
    if getattr(model, "tensor_forms", None):   # a GGUF: how each tensor type runs (stderr: the output stays text)
        print(f"tensors: {model.tensor_forms}", file=sys.stderr)
    runs = [(args.draft, args.k)] + ([("none", 0)] if args.compare and args.draft != "none" else [])
    costs = None
    if args.route and args.draft != "none":   # the router's cost table, measured before anything is timed
        costs = measured_costs(model, cli_drafter(args.draft, model, be, args.model), max_tokens=args.k + 1)
    results = []
    for draft, k in runs:
        how = "" if draft == "none" else f", k <= {k} routed" if costs is not None else f", k = {k} fixed"
        print(f"--- {draft if draft != 'none' else 'plain decoding'} (backend {be.name}{how}) ---")
        text, out, dt, m = run_generate(model, tok, args.prompt, draft, k, args.temperature, args.max_tokens, args.seed,
                                        costs=costs if draft != "none" else None, model_name=args.model,
                                        template=template)
        results.append((draft, out, dt))
        print(f"[{len(out)} tokens in {dt:.2f}s = {len(out) / dt:.1f} tok/s; acceptance rate "
              f"{m.acceptance_rate:.2f}, mean acceptance length {m.mean_acceptance_length:.2f}]")
    if len(results) == 2:
        (_, spec, ts), (_, plain, tp) = results
        same = "identical" if spec == plain else "different"
        print(f"speedup {len(spec) / ts / (len(plain) / tp):.2f}x; outputs {same}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hal.checks import MAX_K
    ap = argparse.ArgumentParser(prog="spec-hal", description="spec-hal: speculative decoding HAL")
    sub = ap.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="backends, availability, block sizes, validation level; the CPU and "
                                       "the runner's linear plan")
    add_dtype_args(info)
    c = sub.add_parser("conformance", help="run the conformance suite against a backend "
                                           "(extra arguments go to pytest)")
    c.add_argument("--backend", required=True)
    c.add_argument("--plugin", action="append", default=[], help="extra plugin module (repeatable)")
    c.add_argument("--fuzz", type=int, metavar="N", help="run only the property-based fuzz, N cases in all "
                                                          "(split evenly over the ops and properties)")
    c.add_argument("--slow", action="store_true", help="also run the slow statistical tests (the long tail)")
    dm = sub.add_parser("demo", help="a real model, speculative vs plain decoding (--ops: one verify round)")
    add_dtype_args(dm)
    dm.add_argument("--ops", action="store_true", help="only show one verify round on toy logits")
    mo = sub.add_parser("model", help="model files")
    mo_sub = mo.add_subparsers(dest="model_cmd", required=True)
    mf = mo_sub.add_parser("fetch", help="download and verify a model into $HAL_CACHE")
    mf.add_argument("name")
    me = mo_sub.add_parser("export-drafter", help="write a shipped drafter whole in its published layout (EAGLE-3: "
                                                  "SafeAILab's; dspark: DeepSpec's, with the target's embeddings and "
                                                  "lm_head), for vLLM, SGLang or the authors' code")
    me.add_argument("kind", choices=("eagle", "dspark"))
    me.add_argument("--model", default="smollm2-135m", type=model_flag, help="the target it was trained for")
    me.add_argument("--out", required=True, help="a new or empty folder")
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    add_dtype_args(g)
    g.add_argument("--model", default="smollm2-135m", type=model_flag, help="a fetchable name or a .gguf path")
    g.add_argument("--draft", default="ngram", help=draft_help(draft_kinds(cli=True)))
    g.add_argument("--prompt", required=True, help="the user's turn (rendered with the chat template)")
    g.add_argument("--k", type=bounded(int, 0, MAX_K), default=5, help="the cap on drafts per step (k itself "
                                                                     "with --no-route)")
    g.add_argument("--route", action=argparse.BooleanOptionalAction, default=True,
                   help="the router chooses k (0 included) per step from profiled costs and measured acceptance "
                        "(the default); --no-route: a fixed k")
    g.add_argument("--temperature", type=bounded(float, 0, finite=True), default=0.0, help="0: greedy")
    g.add_argument("--max-tokens", type=bounded(int, 1), default=128, help="tokens to generate")
    g.add_argument("--seed", type=int, default=0, help="the sampling seed")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and compare")
    b = sub.add_parser("bench", help="routed speculative decoding on the demo prompts; prints a summary and "
                                     "the metrics in Prometheus text format (needs prometheus-client)")
    b.add_argument("--model", default="smollm2-135m", type=model_flag, help="a fetchable name or a .gguf path")
    add_dtype_args(b)
    b.add_argument("--draft", default="ngram", help=draft_help(draft_kinds(cli=True)))
    b.add_argument("--k", type=bounded(int, 0, MAX_K), default=8, help="the cap on k (routed) or k itself (--fixed-k)")
    b.add_argument("--fixed-k", action="store_true", help="no router: always k drafts")
    b.add_argument("--batch", type=int, default=1, help="copies of each demo prompt in the batch")
    b.add_argument("--max-tokens", type=int, default=48)
    add_train_head(sub)
    sub.add_parser("serve", help="an OpenAI-compatible HTTP server (spec-hal serve --help)", add_help=False)
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "conformance":
        return cmd_conformance(args, extra)
    if args.cmd == "serve":
        from hal.server.app import main as serve_main
        return serve_main(extra)
    if extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return {"info": cmd_info, "demo": cmd_demo, "model": cmd_model, "generate": cmd_generate,
                "bench": cmd_bench, "train-head": cmd_train_head}[args.cmd](args)
    except HalError as e:
        print(f"spec-hal: {e}", file=sys.stderr)
        return 2
