"""A rank's start-up: one process (draft in-process), or under torchrun the target rank and
the draft rank (`hal.distributed`: the link, the protocol and the worker's loop).

`start` plans memory before anything is allocated, chooses the linear plan, loads the
target, makes the drafter (or the target's view of the draft rank), and builds the engine
(`hal.launch.build.build_engine`) with its router. The draft rank loads its drafter and
serves drafts until the target stops (`hal.distributed.worker.serve_draft_rank`)."""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch.distributed as dist

from hal.distributed.placement import Placement, link_backend, resolve_side
from hal.distributed.protocol import DRAFT
from hal.distributed.remote import RemoteDrafter, connect
from hal.distributed.rendezvous import Rendezvous
from hal.drafters.kinds import HEADS, draft_kinds, draft_memory, make_drafter, parse_draft
from hal.engine import SpeculativeDecoder
from hal.errors import HalError
from hal.host_threads import in_a_thread_that_ends
from hal.launch.build import build_engine, grammar_compiler, memory_plan, serving_budget
from hal.launch.config import SERVE_BUDGET, LaunchConfig
from hal.launch.phases import QUIET, Phases
from hal.models.fetch import load_model
from hal.models.tokenizer import chat_template_of


@dataclass
class Target:
    """What the target rank runs: the engine, its tokenizer (None: the model has none), the
    link (``world`` 2: a draft rank; ``link``: the first epoch's backend), and the model's chat
    template (`hal.models.chat_template.ChatTemplate`; None: it has none)."""

    dec: SpeculativeDecoder
    tok: object
    world: int
    link: str | None
    side: object
    template: object = None

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


@dataclass(frozen=True)
class Rank:
    """Who this process is: ``world`` 1 (the draft in-process) or 2, its ``rank``, the
    rendezvous (two ranks), the placement, the draft spec and the model's path."""

    world: int
    rank: int
    rv: Rendezvous | None
    placement: Placement
    spec: object
    path: str


def start(config: LaunchConfig, phases: Phases = QUIET) -> Target | None:
    """Set this rank up from its launch config (`hal.launch.config.LaunchConfig`, built once by
    the entry point): under torchrun the draft rank serves drafts until the target stops
    (returns None); the target rank (or a single process) returns its `Target`. ``phases``
    reports each phase of the target's start-up."""
    me = _whoami(config)
    if me.placement.measure:   # HAL_PLACEMENT=auto: measure here (and there), then choose
        me = _auto(config, me, phases)
        if me is None:
            return None
    if me.rank == DRAFT:
        _draft_rank(config, me)
        return None
    return _target_rank(config, me, phases)


def _whoami(config: LaunchConfig) -> Rank:
    from hal.models.fetch import MODELS, fetch
    placement = Placement.from_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world not in (1, 2):
        raise HalError(f"WORLD_SIZE: expected 1 (in-process draft) or 2 (draft and target ranks), got {world}")
    spec = parse_draft(config.draft, draft_kinds(remote=world == 2))
    rank = int(os.environ.get("RANK", "0"))
    # two ranks: the store opens now (bounded); the target announces epoch 0 once it has loaded
    rv = Rendezvous(rank, link_backend(placement), config.draft_startup_timeout) if world == 2 else None
    weightless = rank == DRAFT and spec.kind in ("ngram", "ngram-tree")   # an n-gram worker needs no weights
    path = str(fetch(config.model) if config.model in MODELS and not weightless else config.model)
    return Rank(world, rank, rv, placement, spec, path)


def _target_rank(config: LaunchConfig, me: Rank, phases: Phases) -> Target:
    """Plan, load, draft, build: the target's start-up, one phase at a time."""
    from hal.engine.memory import ModelMemory
    from hal.metrics import SpecDecodeMetrics
    from hal.models.linear_plan import choose_plan, pin_head
    from hal.models.llama import linear_shapes
    from hal.models.loaders import coded_plan, head_q8, model_file, read_config, stored_masks
    spec, world = me.spec, me.world
    target_side = resolve_side(me.placement.target, "target")
    draft_side = resolve_side(me.placement.draft, "draft") if world == 1 else None
    shares = world == 1 and draft_side.device == target_side.device
    dmem, dpath = draft_memory(spec, me.path, shares) if world == 1 else (None, None)
    cfg = read_config(me.path)
    if cfg.max_context is not None and config.max_context > cfg.max_context:   # as vLLM refuses it
        raise HalError(f"--max-model-len / --max-context: expected at most {cfg.max_context} tokens, the context "
                       f"{config.model} was trained to, got {config.max_context}", arg="max_model_len")
    with phases("linear plan (measured once per machine, then cached)"):
        choice = choose_plan(linear_shapes(cfg), config.dtype, refresh=config.plan_refresh, device=target_side.device,
                             progress=phases.bars, **stored_masks(me.path, cfg), q8_head=head_q8(me.path),
                             q6k_head=head_q8(me.path, "Q6_K"))
        plan = pin_head(choice, config.lm_head)
        if plan.weights == "q4q8" and not os.path.isdir(me.path):   # its rows' codes, said below (`file_row_codes`)
            plan = coded_plan(plan, model_file(me.path).tensors, config.row_codes)
    phases.say(f"linear plan: {plan.describe()} ({'cached' if choice.from_cache else 'now'}; "
               f"{choice.conditions()})")
    with phases("memory plan"):
        tmem = replace(ModelMemory.from_config(cfg, "target", kv_dtype=plan.dtype),
                       feature_bytes=_feature_bytes(config, spec, cfg))
        mplan = memory_plan(config, tmem, target_side, dmem, draft_side, config.max_num_seqs)
        pool = mplan.allocate("target")  # nothing was allocated before the plan passed
    with phases(f"load {config.model}"):
        model, tok = load_model(me.path, target_side.backend, plan=plan, row_codes=str(plan.codes))
        model.batch_invariant = config.batch_invariant
        model.to(target_side.device)
    if getattr(model, "tensor_forms", None):   # a GGUF: how each tensor type runs
        phases.say(f"tensors: {model.tensor_forms}")
    phases.say(f"between the matmuls: {model.rows.describe}; the layers: "
               f"{'one native call' if model.loop is not None else 'a Python loop'}")
    metrics = SpecDecodeMetrics()
    head = spec.kind in HEADS   # an EAGLE head: it reads the target's features
    with phases(f"draft {config.draft}"):
        if world == 2:
            drafter = _remote(config, me.rv, spec, model, target_side, metrics, head)
        else:
            drafter = make_drafter(spec, draft_side.backend, target=model if shares or head else None,
                                   path=config.model if head else dpath,
                                   pool=mplan.allocate("draft") if dmem else None, device=draft_side.device,
                                   vocabulary=(model.cfg.vocab, tok))
            drafter = _threaded(config, spec, drafter, model.cfg.vocab, target_side, draft_side, metrics, phases)
    inline = world == 1 and not isinstance(drafter, RemoteDrafter)   # a draft thread is profiled as a worker is
    budget = config.max_num_batched_tokens
    if budget == SERVE_BUDGET:
        budget = serving_budget(target_side.device.type, config.max_num_seqs)
        phases.say(f"chunked prefill: {budget} tokens a step (--max-num-batched-tokens unset: the default for "
                   f"{target_side.device.type})")
    engine_kw = {"max_num_batched_tokens": budget, "max_num_seqs": config.max_num_seqs}
    dec = _engine(config, model, drafter, pool, metrics, grammar_compiler(tok, model.cfg, phases.say), inline,
                  engine_kw, phases)
    return Target(dec, tok, world, me.rv.backend if world == 2 else None, target_side, chat_template_of(me.path))


def _feature_bytes(config: LaunchConfig, spec, cfg) -> int:
    """Bytes per target position that the feature cache keeps (`hal.engine.feature_cache`): one float32
    row per tap of a drafter that reads the target's features, with prefix caching on; else 0."""
    from hal.drafters.kinds import feature_layers
    taps = feature_layers(spec, config.model, cfg.layers)
    if taps is None or config.enable_prefix_caching is False:
        return 0
    return max(1, len(taps)) * cfg.hidden * 4


def _threaded(config: LaunchConfig, spec, drafter, vocab: int, target_side, draft_side, metrics, phases: Phases):
    """``drafter`` on its own thread, one round ahead (`hal.distributed.local.ThreadDrafter`),
    where ``--draft-thread`` asks for it: ``on``, or ``auto`` with the draft on another device
    than the target; else ``drafter`` itself."""
    mode = config.draft_thread
    if drafter is None or mode == "off" or (mode == "auto" and draft_side.device == target_side.device):
        return drafter
    from hal.distributed.local import ThreadDrafter
    from hal.launch.measure import worker_fanout
    fanout = worker_fanout(config, spec)
    phases.say(f"draft on its own thread ({draft_side.device}), one round ahead: fan-out {fanout}")
    return ThreadDrafter(drafter, vocab, target_side.device, metrics, timeout=config.draft_timeout, fanout=fanout,
                         push=config.push)


def _engine(config: LaunchConfig, model, drafter, pool, metrics, grammar, profile_draft: bool, engine_kw: dict,
            phases: Phases) -> SpeculativeDecoder:
    route = config.route and drafter is not None
    asked = config.enable_prefix_caching
    with phases("routing profile (the target's and the drafter's costs, measured)") if route else nullcontext():
        dec = build_engine(model, drafter, k=config.k, route=route, pool=pool, metrics=metrics, grammar=grammar,
                           enable_prefix_caching=asked,
                           profile={"profile_draft": profile_draft, "progress": phases.bars}, **engine_kw)
    phases.say(f"prefix caching {'on' if dec.prefix_caching else 'off'}" + (
        " (with the cached blocks' target features, which the drafter reads)" if dec.cached_features is not None
        else ""))
    return dec


def _draft_rank(config: LaunchConfig, me: Rank) -> None:
    """The draft rank: plan and load its drafter, then serve drafts until the target stops."""
    from hal.distributed.worker import serve_draft_rank
    from hal.launch.measure import worker_fanout
    head = me.spec.kind in HEADS   # an EAGLE head: it reads the target's features
    draft_side = resolve_side(me.placement.draft, "draft")
    mem, dpath = draft_memory(me.spec, me.path, shares_target=False)
    plan = memory_plan(config, None, None, mem, draft_side, config.max_num_seqs) if mem is not None else None

    def load():   # a head shares the target's embeddings and lm_head: this rank loads the weights for them
        pool = plan.allocate("draft") if plan is not None else None
        tw = load_model(me.path, draft_side.backend, config.dtype, lm_head=config.lm_head,
                        row_codes=config.row_codes)[0].to(draft_side.device) \
            if head else None
        return tw, make_drafter(me.spec, draft_side.backend, target=tw, path=config.model if head else dpath,
                                pool=pool, device=draft_side.device)
    tw, drafter = in_a_thread_that_ends(load)   # the epochs' threads draft: no OpenMP team left here
    serve_draft_rank(me.rv, drafter, draft_side.device, hidden=tw.cfg.hidden if head else 1, k=config.k,
                     draft_timeout=config.draft_timeout, join_timeout=config.draft_startup_timeout,
                     fanout=worker_fanout(config, me.spec), push=config.push)


def _auto(config: LaunchConfig, me: Rank, phases: Phases) -> Rank | None:
    """This rank as `hal.launch.measure` placed it; None on a draft rank the target did not
    choose (it exits)."""
    import sys
    from dataclasses import replace

    from hal.launch.measure import auto_target, auto_worker
    if me.rank == DRAFT:
        chosen = auto_worker(config, me.spec, me.path, me.rv)
        if chosen is None:
            print("hal.launch worker: placement auto put the draft in the target's process (or nowhere); this "
                  "rank exits", file=sys.stderr, flush=True)
            return None
        return replace(me, placement=Placement(draft=chosen))
    with phases("automatic placement (each device measured)"):
        placement, choice = auto_target(config, me.spec, me.path, config.max_num_seqs, me.rv)
    spec = parse_draft("none") if choice.best.draft is None else me.spec
    world = 1 if me.world == 2 and choice.best.where != "other rank" else me.world   # the worker was told to exit
    return replace(me, placement=placement, spec=spec, world=world)


def _remote(config: LaunchConfig, rv: Rendezvous, spec, model, target_side, metrics, head: bool) -> RemoteDrafter:
    from hal.drafters.kinds import feature_layers
    layers = feature_layers(spec, config.model, model.cfg.layers) if head else None
    return connect(rv, model.cfg.vocab, target_side.device, metrics, draft_timeout=config.draft_timeout,
                   startup_timeout=config.draft_startup_timeout, features=layers, push=config.push)
