"""The one place an engine is assembled: memory plan, pool, grammar compiler, router and the
`hal.engine.SpeculativeDecoder` itself.

Every entry point builds through `build_engine` (the CLI, the server and the two-rank
launcher through `hal.launch.start`, automatic placement's measurement, the training data);
the router is passed at construction, from costs profiled in the engine's own pool before
the engine exists (or costs measured earlier, shared between engines over one model)."""

from __future__ import annotations

import sys

from hal.engine import SpeculativeDecoder
from hal.engine.memory import GiB, Plan, plan_memory, target_pool
from hal.engine.drafting import capabilities
from hal.engine.costs import CostModel, profile_costs
from hal.engine.route_memory import RouteMemory
from hal.engine.router import Router
from hal.launch.config import LaunchConfig

PROBE_EVERY = 16   # a request at k = 0 is measured every this many plain steps (a probe, or a scored draft)


# vLLM's default budget for its OpenAI server is 2048 tokens a step on GPUs (more on the biggest); it is
# chosen per platform. A CPU prefills some hundreds of tokens a second, so 2048 would freeze every
# running stream for seconds: the budget here is per device type (benchmarks/prefill_stall.py).
SERVE_BUDGETS = {"cpu": 256}
ACCELERATOR_BUDGET = 2048


def serving_budget(device_type: str, max_num_seqs: int) -> int:
    """The tokens a serving step feeds the target when ``--max-num-batched-tokens`` is unset:
    chunked prefill on, at the device type's budget, never below ``max_num_seqs`` (every running
    request feeds at least one token), as vLLM raises it."""
    return max(SERVE_BUDGETS.get(device_type, ACCELERATOR_BUDGET), max_num_seqs)


def make_router(costs: CostModel, drafter, max_k: int, memory: RouteMemory | None = None) -> Router:
    """The router over ``costs`` for ``drafter``, k capped at ``max_k``; a shadow-scored
    drafter (n-gram lookup) is never probed with a verified draft: its first draft is scored
    unverified, on a greedy request's steps as often as its measured cost allows
    (`Router.score_every`) and every ``PROBE_EVERY`` of a sampled one."""
    caps = capabilities(drafter)
    return Router(costs, max_k=max_k, probe_every=PROBE_EVERY, shadow=caps.shadow, lookup=caps.lookup,
                  fallback=caps.fallback, memory=memory)


def build_engine(target, drafter=None, *, k: int = 8, route: bool = False, costs: CostModel | None = None,
                 pool=None, num_blocks: int = 512, profile: dict | None = None, **engine_kw) -> SpeculativeDecoder:
    """The engine over ``target`` (a `hal.models.llama.Llama`) and ``drafter`` (None: plain
    decoding). ``pool``: a planned KV pool (`memory_plan`), else ``num_blocks`` blocks unplanned.
    With ``route`` (and a drafter) a `hal.engine.router.Router` chooses k <= ``k`` per request and
    step, from ``costs`` or, without them, costs profiled now in the pool (``profile``: keyword
    arguments of `hal.engine.costs.profile_costs`). ``engine_kw`` go to `SpeculativeDecoder`."""
    pool = pool or target_pool(target, num_blocks)
    router = None
    if route and drafter is not None:
        if costs is None:
            costs = profile_costs(target, drafter, pool, **(profile or {}))
        router = make_router(costs, drafter, k, RouteMemory.for_engine(target, drafter))
    return SpeculativeDecoder(target, drafter, pool=pool, router=router, **engine_kw)


def memory_plan(config: LaunchConfig, target_mem, target_side, draft_mem, draft_side, max_seqs: int) -> Plan:
    """This rank's memory plan from its launch config (the context, k, the memory fraction and
    the CPU budget), printed on stderr; raises `HalError` before anything is allocated."""
    p = plan_memory(target_mem, target_side, draft_mem, draft_side,
                    max_seqs=max(1, max_seqs), max_context=config.max_context,
                    max_k=config.k, budget_fraction=config.memory_fraction,
                    budget_bytes={"cpu": int(config.cpu_budget_gib * GiB)})
    print(p.report(), file=sys.stderr, flush=True)
    return p


def local_pool(model, max_seqs: int, max_context: int, max_k: int, cpu_budget_gib: float = 4.0):
    """A planned KV pool for a local engine over a loaded ``model`` (the CLI's): ``max_seqs``
    sequences of ``max_context`` tokens verifying up to ``max_k`` drafts, within the device's
    budget (``cpu_budget_gib`` on cpu); `HalError` saying what to change where it cannot fit."""
    from hal.distributed.placement import Side
    from hal.engine.memory import ModelMemory
    side = Side(model.be, model.device, str(model.device))
    plan = plan_memory(ModelMemory.from_config(model.cfg, "target", kv_dtype=model.dtype), side,
                       max_seqs=max(1, max_seqs), max_context=max_context, max_k=max_k,
                       budget_bytes={"cpu": int(cpu_budget_gib * GiB)})
    return plan.allocate("target")


def grammar_compiler(tok, cfg, say=lambda line: None):
    """Structured outputs for this tokenizer (`hal.engine.grammar`), or None where the model
    has no tokenizer or llguidance is not installed (then ``say`` is told why)."""
    if tok is None or not cfg.stop_ids:
        return None
    try:
        import llguidance  # noqa: F401
    except ImportError:
        say("structured outputs off (pip install llguidance)")
        return None
    from hal.engine.grammar import GrammarCompiler
    return GrammarCompiler(tok.to_str(), cfg.vocab, tuple(cfg.stop_ids))


def cli_drafter(draft: str, target, backend, model: str = "smollm2-135m"):
    """A drafter for the CLI's ``--draft`` over a loaded ``target`` (`hal.drafters.kinds`): none,
    ngram, ngram-tree, self[:L], eagle[:<folder>], ngram+eagle[:<folder>] or their -tree forms,
    dspark[:<folder>] or ngram+dspark[:<folder>] (without a folder: the head or block drafter
    shipped for ``model``)."""
    from hal.drafters.kinds import draft_kinds, make_drafter, parse_draft
    return make_drafter(parse_draft(draft, draft_kinds(cli=True)), backend, target=target, path=model)
