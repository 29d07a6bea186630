"""Draft and target in different processes or hosts.

    torchrun --nproc-per-node 2 -m hal.distributed.launcher --draft self:8 --prompt "..."
    HAL_PLACEMENT="draft=cpu,target=cuda:0" torchrun --nproc-per-node 2 -m hal.distributed.launcher ...

Rank 0 runs the target and the `SpeculativeDecoder`; rank 1 is the draft worker. The
link is gloo for cpu and cross-vendor pairs, the backends' own collective (nccl, hccl)
when both sides share it. One round: the target sends COMMIT (the tokens it committed
since the last round and each request's k), the worker answers DRAFTS built on exactly
that committed prefix, which the target checks (base length and hash) before verifying;
so the draft never builds on uncommitted tokens and a stale draft is dropped.

Overlap: right after answering, while the target verifies, the worker drafts the next
round assuming everything is accepted and guessing the bonus token (its own next
draft). If the COMMIT that arrives matches that guess the reply is immediate; else the
guess is dropped and the worker drafts afresh. If the worker dies or times out, the
target finishes every request by plain decoding (identical output; counted in
``metrics.draft_failures``). Without torchrun (WORLD_SIZE unset) the draft runs in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hal.engine import Request, SpeculativeDecoder
from hal.engine.requests import capabilities
from hal.errors import HalError
from hal.drafters.registry import HEADS, draft_help, draft_kinds, draft_memory, make_drafter, parse_draft
from hal.models.fetch import load_model
from hal.distributed.placement import Placement, link_backend
from hal.distributed.protocol import DRAFT, Link
from hal.distributed.remote import RemoteDrafter
from hal.distributed.startup import QUIET, Phases
from hal.distributed.rendezvous import Rendezvous
from hal.distributed.worker import serve_epochs


def plan(args, target_mem, target_side, draft_mem, draft_side, max_seqs: int):
    """This rank's memory plan (printed); raises `HalError` before anything is allocated."""
    from hal.engine.memory import GiB, plan_memory
    p = plan_memory(target_mem, target_side, draft_mem, draft_side,
                    max_seqs=max(1, max_seqs), max_context=args.max_context,
                    max_k=args.k, budget_fraction=args.memory_fraction,
                    budget_bytes={"cpu": int(args.cpu_budget_gib * GiB)})
    print(p.report(), file=sys.stderr, flush=True)
    return p


@dataclass
class Target:
    """What the target rank runs: the engine, its tokenizer (None for HF folders), and the
    link (``world`` 2: a draft rank; ``link``: the first epoch's backend)."""

    dec: SpeculativeDecoder
    tok: object
    world: int
    link: str | None
    side: object

    @property
    def degraded(self) -> str | None:
        """Why speculation is off now (the draft rank is not joined), else None."""
        d = self.dec.drafter
        if isinstance(d, RemoteDrafter) and not d.alive:
            return ("the draft worker did not join; decoding plainly" if d.rounds == 0 and d.lost
                    else "the draft worker was lost; decoding plainly")
        return None

    def on_idle(self) -> None:
        """Called by the engine's thread while nothing runs: a draft worker waiting to
        rejoin is taken back now, not at the next request."""
        if isinstance(self.dec.drafter, RemoteDrafter):
            self.dec.drafter.take_back()

    def close(self) -> None:
        if isinstance(self.dec.drafter, RemoteDrafter):
            self.dec.drafter.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def add_dtype_args(ap: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--plan-refresh``: the runner's linear plan (`hal.models.linear_plan`)."""
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the linear layers' and KV cache's dtype (auto: bfloat16 where it measures faster and "
                         "batch-invariant on this CPU, else float32)")
    ap.add_argument("--plan-refresh", action="store_true", help="measure the linear plan again (it is cached "
                                                                 "per CPU signature under $HAL_CACHE/plans)")


def model_flag(value: str) -> str:
    """``--model``: a fetchable name or an existing path (argparse refuses it before loading)."""
    from hal.models.fetch import MODELS
    if value not in MODELS and not os.path.exists(value):
        raise argparse.ArgumentTypeError(f"expected one of {sorted(MODELS)}, a .gguf path or an HF folder, got "
                                         f"{value!r} (no such model name or path)")
    return value


def draft_flag(value: str) -> str:
    """``--draft``: a kind of `hal.drafters.registry.DRAFT_KINDS`, its path existing where it names one."""
    try:
        spec = parse_draft(value)
    except HalError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--draft: ")) from None
    if spec.path is not None and not os.path.exists(spec.path):
        raise argparse.ArgumentTypeError(f"expected an existing path after {spec.kind}:, got {spec.path!r} "
                                         "(no such file or folder)")
    return value


def bounded(kind, lo=None, hi=None, lo_open: bool = False):
    """An argparse type: ``kind`` within ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an int' if kind is int else 'a number'}, got {text!r}") \
                from None
        if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            span = f"{'>' if lo_open else '>='} {lo}" if hi is None else \
                f"in {'(' if lo_open else '['}{lo}, {hi}]" if lo is not None else f"<= {hi}"
            raise argparse.ArgumentTypeError(f"expected a value {span}, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The flags every target entry point shares (names as vLLM's where one exists); a bad
    value or a missing path is refused by argparse (exit 2, naming the flag) before loading."""
    from hal.checks import MAX_K
    add_dtype_args(ap)
    ap.add_argument("--draft", default="ngram", type=draft_flag, help=draft_help())
    ap.add_argument("--model", default="smollm2-135m", type=model_flag,
                    help="a fetchable name, a .gguf path or an HF folder")
    ap.add_argument("--k", type=bounded(int, 0, MAX_K), default=8, help=f"the cap on k per request and step "
                                                                        f"(0..{MAX_K}); k itself with --no-route")
    ap.add_argument("--route", action=argparse.BooleanOptionalAction, default=True,
                    help="the router chooses k (0 included) per request and step from the costs profiled at "
                         "start-up and the measured acceptance (the default); --no-route: a fixed k every step")
    ap.add_argument("--draft-startup-timeout", type=bounded(float, 0, lo_open=True), default=60.0,
                    help="seconds the target waits for the draft worker to join and send its first drafts; "
                         "then it serves alone by plain decoding")
    ap.add_argument("--draft-timeout", type=bounded(float, 0, lo_open=True), default=30.0,
                    help="seconds to wait for drafts before falling back to plain decoding")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="compute the target in fixed shapes, so greedy output never depends on the batch "
                         "(the default; --no-batch-invariant trades that for batched-decode throughput)")
    ap.add_argument("--memory-fraction", type=bounded(float, 0, 1, lo_open=True), default=0.9,
                    help="share of an accelerator's memory to plan in")
    ap.add_argument("--cpu-budget-gib", type=bounded(float, 0, lo_open=True), default=4.0,
                    help="memory budget of a cpu side, GiB")
    ap.add_argument("--placement-acceptance", type=bounded(float, 0, 1), default=0.6,
                    help="HAL_PLACEMENT=auto: the draft acceptance rate the choice assumes")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the target KV of prompt blocks seen before (default: on, unless the drafter "
                         "reads the target's features: an EAGLE head; --enable-prefix-caching then refuses)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hal.distributed.launcher", description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--prompt", action="append", default=[], help="repeatable: one request each")
    ap.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable); "
                                                                      "for models without a tokenizer")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write outputs and metrics as JSON here")
    ap.add_argument("--max-context", type=int, default=2048, help="prompt + generated tokens per request (planned)")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except HalError as e:
        print(f"hal.distributed.launcher: {e}", file=sys.stderr)
        return 2


def start(args, max_seqs: int, engine_kw: dict | None = None, phases: Phases = QUIET) -> Target | None:
    """Set this rank up: under torchrun the draft rank serves drafts until the target stops
    (returns None); the target rank (or a single process) returns its `Target`. ``phases``
    reports each phase of the target's start-up (`hal.distributed.startup.Phases`)."""
    from hal.metrics import SpecDecodeMetrics
    placement = Placement.from_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world not in (1, 2):
        raise HalError(f"WORLD_SIZE: expected 1 (in-process draft) or 2 (draft and target ranks), got {world}")
    spec = parse_draft(args.draft, draft_kinds(remote=world == 2))
    rank = int(os.environ.get("RANK", "0"))
    rv = None
    if world == 2:   # the store opens now (bounded); the target announces epoch 0 once it has loaded
        rv = Rendezvous(rank, link_backend(placement), args.draft_startup_timeout)
    from hal.models.fetch import MODELS, fetch
    from hal.models.linear_plan import choose_plan
    from hal.models.llama import linear_shapes, read_config
    from hal.distributed.placement import resolve_side
    from hal.engine.memory import ModelMemory
    path = str(fetch(args.model) if args.model in MODELS and not (rank == DRAFT and spec.kind in ("ngram", "ngram-tree"))
               else args.model)  # an n-gram worker needs no weights
    if placement.measure:   # HAL_PLACEMENT=auto: measure here (and there), then choose
        placement, spec, world = _auto(args, spec, path, max_seqs, rv, rank, world, phases)
        if placement is None:
            return None
    head = spec.kind in HEADS   # an EAGLE head: it reads the target's features
    if rank == DRAFT:  # plan, allocate, load, serve
        return serve_draft_rank(args, spec, path, placement, rv, max_seqs)
    target_side = resolve_side(placement.target, "target")
    draft_side = resolve_side(placement.draft, "draft") if world == 1 else None
    shares = world == 1 and draft_side.device == target_side.device
    dmem, dpath = draft_memory(spec, path, shares) if world == 1 else (None, None)
    cfg = read_config(path)
    with phases("linear plan (measured once per machine, then cached)"):
        choice = choose_plan(linear_shapes(cfg), args.dtype, refresh=args.plan_refresh, device=target_side.device,
                             progress=phases.bars)
    linear = choice.plan
    phases.say(f"linear plan: {linear.describe()} ({'cached' if choice.from_cache else 'now'}; {choice.conditions()})")
    with phases("memory plan"):
        mplan = plan(args, ModelMemory.from_config(cfg, "target", kv_dtype=linear.dtype), target_side, dmem,
                     draft_side, max_seqs)
        pool = mplan.allocate("target")  # nothing was allocated before the plan passed
    with phases(f"load {args.model}"):
        model, tok = load_model(path, target_side.backend, plan=linear)
        model.batch_invariant = getattr(args, "batch_invariant", True)
        model.to(target_side.device)
    metrics = SpecDecodeMetrics()
    with phases(f"draft {args.draft}"):
        if world == 2:
            drafter = _remote(args, rv, spec, model, target_side, metrics, head)
        else:
            drafter = make_drafter(spec, draft_side.backend, target=model if shares or head else None,
                                   path=args.model if head else dpath,
                                   pool=mplan.allocate("draft") if dmem else None, device=draft_side.device)
    asked = getattr(args, "enable_prefix_caching", None)
    dec = SpeculativeDecoder(model, drafter, metrics=metrics, pool=pool, enable_prefix_caching=asked,
                             grammar=grammar_compiler(tok, model.cfg, phases), **(engine_kw or {}))
    phases.say(f"prefix caching {'on' if dec.prefix_caching else 'off'}" + (
        " (the drafter reads the target's features of every position)" if asked is None and not dec.prefix_caching
        else ""))
    if args.route and drafter is not None:
        from hal.engine.router import Router
        with phases("routing profile (the target's and the drafter's costs, measured)"):
            dec.router = Router(dec.profile_costs(profile_draft=world == 1, progress=phases.bars), max_k=args.k,
                                probe_every=0 if capabilities(drafter).shadow else 16)   # shadows are scored free
    return Target(dec, tok, world, rv.backend if world == 2 else None, target_side)


def serve_draft_rank(args, spec, path: str, placement, rv, max_seqs: int) -> None:
    """The draft rank under torchrun: plan and load its drafter, then serve drafts epoch by
    epoch (`hal.distributed.worker.serve_epochs`) until the target stops."""
    from hal.distributed.placement import resolve_side
    head = spec.kind in HEADS   # an EAGLE head: it reads the target's features
    signal.signal(signal.SIGTERM, _quiet_exit)   # torchrun forwards its SIGTERM: end like the target, exit 0
    draft_side = resolve_side(placement.draft, "draft")
    mem, dpath = draft_memory(spec, path, shares_target=False)
    pool = plan(args, None, None, mem, draft_side, max_seqs).allocate("draft") if mem is not None else None
    # a head shares the target's embeddings and lm_head: this rank loads the weights for them
    tw = load_model(path, draft_side.backend, args.dtype)[0].to(draft_side.device) if head else None
    drafter = make_drafter(spec, draft_side.backend, target=tw, path=args.model if head else dpath, pool=pool,
                           device=draft_side.device)
    if drafter is not None:   # its first call pays for the kernels' set-up (~1 s): not in the first round
        from hal.engine.router import profile_drafter
        profile_drafter(drafter, draft_side.device, tw.cfg.hidden if head else 1, reps=1, points=(1, max(1, args.k)))
    try:
        serve_epochs(rv, drafter, draft_side.device, os.environ.get("HAL_SERVE_FAULT", ""),
                     idle=max(600.0, args.draft_timeout), join_timeout=args.draft_startup_timeout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _quiet_exit(signum, frame) -> None:
    """SIGTERM on the draft rank: exit 0 now. It holds nothing to flush, and unwinding past a
    live gloo thread would end in std::terminate."""
    print("hal.distributed.launcher worker: SIGTERM; stopping", file=sys.stderr, flush=True)
    os._exit(0)


def _auto(args, spec, path: str, max_seqs: int, rv, rank: int, world: int, phases: Phases):
    """``(Placement, draft spec, world)`` chosen by `hal.distributed.measure`; (None, ..) on a
    draft rank the target did not choose (it exits)."""
    from hal.distributed.measure import auto_target, auto_worker
    if rank == DRAFT:
        chosen = auto_worker(args, spec, path, rv)
        if chosen is None:
            print("hal.distributed.launcher worker: placement auto put the draft in the target's process (or "
                  "nowhere); this rank exits", file=sys.stderr, flush=True)
        return (None if chosen is None else Placement(draft=chosen)), spec, world
    with phases("automatic placement (each device measured)"):
        placement, choice = auto_target(args, spec, path, max_seqs, rv)
    if choice.best.draft is None:
        spec = parse_draft("none")
    if world == 2 and choice.best.where != "other rank":
        world = 1   # the draft runs in this process (or nowhere): the worker was told to exit
    return placement, spec, world


def _remote(args, rv: Rendezvous, spec, model, target_side, metrics, head: bool) -> RemoteDrafter:
    """The target's view of the draft rank: epoch 0's link, or (the worker did not join
    within the start-up timeout) none yet, with epoch 1 open for it to join late."""
    layers = None
    if head:
        from hal.models.eagle import head_feature_layers, shipped_head
        layers = head_feature_layers(spec.path or shipped_head(args.model), model.cfg.layers)
    rv.announce(0)   # ready to meet: the bound starts now, not at process start
    try:
        gloo = rv.backend == "gloo"
        link = Link(DRAFT, torch.device("cpu") if gloo else target_side.device, rv.group(0, args.draft_startup_timeout),
                    framed=gloo)
    except HalError as e:
        print(f"hal.distributed.launcher: the draft worker did not join within {args.draft_startup_timeout} s "
              f"({e}); serving alone by plain decoding until it joins", file=sys.stderr, flush=True)
        link = None
        metrics.draft_failures += 1
    return RemoteDrafter(link, model.cfg.vocab, target_side.device, metrics, args.draft_timeout,
                         first_timeout=args.draft_startup_timeout, features=layers, rendezvous=rv)


def grammar_compiler(tok, cfg, phases: Phases):
    """Structured outputs for this tokenizer (`hal.engine.grammar`), or None where the model
    has no tokenizer or llguidance is not installed (said at start-up)."""
    if tok is None or not cfg.stop_ids:
        return None
    try:
        import llguidance  # noqa: F401
    except ImportError:
        phases.say("structured outputs off (pip install llguidance)")
        return None
    from hal.engine.grammar import GrammarCompiler
    return GrammarCompiler(tok.to_str(), cfg.vocab, tuple(cfg.stop_ids))


def _run(args) -> int:
    from hal.models.tokenizer import chatml
    t0 = start(args, len(args.prompt) + len(args.prompt_ids))
    if t0 is None:   # the draft rank
        return 0
    dec, tok, world, backend, target_side = t0.dec, t0.tok, t0.world, t0.link, t0.side
    model, drafter, metrics = dec.target, dec.drafter, dec.metrics
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
    if args.prompt and tok is None:
        raise HalError(f"--prompt: model {args.model} has no tokenizer; pass --prompt-ids")
    prompts += [tok.encode(chatml(p)).ids for p in args.prompt]
    if not prompts:
        raise HalError("--prompt: expected at least one --prompt or --prompt-ids, got none")
    if (longest := max(map(len, prompts)) + args.max_tokens) > args.max_context:
        raise HalError(f"--max-context: expected at least the longest prompt + --max-tokens = {longest} tokens "
                       f"(the memory plan's context), got {args.max_context}")
    reqs = [Request(p, max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    seed=args.seed + i, k=args.k, stop_ids=model.cfg.stop_ids) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    try:
        outs = dec.generate(reqs)
    finally:
        t0.close()
    dt = time.perf_counter() - t
    for p, o in zip(args.prompt_ids + args.prompt, outs):
        print(f"=== {p[:60]!r}\n{o if tok is None else tok.decode(o, skip_special_tokens=True)}\n")
    m = metrics
    summary = {"outputs": outs, "seconds": dt, "tokens": sum(map(len, outs)), "world_size": world,
               "link": backend if world == 2 else None, "target": f"{target_side.backend.name}@{target_side.device}",
               "acceptance_rate": m.acceptance_rate, "mean_acceptance_length": m.mean_acceptance_length,
               "draft_failures": m.draft_failures, "stale_drafts": m.stale_drafts,
               "overlap_hits": getattr(drafter, "guess_hits", 0), "overlap_misses": getattr(drafter, "guess_misses", 0),
               "steps": dec.steps}
    if world == 2 and drafter is not None:   # what crossed the link, and the share of time spent in rounds
        summary.update(rounds=drafter.rounds, round_trip_seconds=drafter.wait_s, epoch=drafter.epoch,
                       workers_lost=m.workers_lost, workers_rejoined=m.workers_rejoined,
                       bytes_sent=drafter.bytes_sent, bytes_received=drafter.bytes_received)
    print(json.dumps({k: v for k, v in summary.items() if k != "outputs"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
