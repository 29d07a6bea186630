"""The flags every target entry point shares (``spec-hal serve``, ``python -m hal.launch``);
names as vLLM's where one exists. A bad value or a missing path is refused by argparse (exit 2,
naming the flag) before anything loads."""

from __future__ import annotations

import argparse
import os

from hal.drafters.kinds import draft_help, parse_draft
from hal.errors import HalError


def add_dtype_args(ap: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--lm-head`` and ``--plan-refresh``: the runner's linear plan (`hal.models.linear_plan`)."""
    from hal.models.linear_plan import CHOICES, LM_HEADS
    ap.add_argument("--dtype", default="auto", choices=CHOICES,
                    help="how the linear layers run (auto: the fastest batch-invariant choice measured on this CPU "
                         "among float32, bfloat16 where the CPU has a bf16 unit, and the file's Q4_0/Q4_1 weights "
                         "as stored; stored: the int4 weights as stored, other weights and the KV cache in the "
                         "rows' dtype; float32, bfloat16: every weight dequantized to that dtype)")
    ap.add_argument("--lm-head", default="auto", choices=LM_HEADS,
                    help="the lm_head's form under an int4 plan (auto: the faster of the two measured on this CPU; "
                         "stored: the file's Q8_0 codes as stored, refused where the plan is not int4 or the head "
                         "is not Q8_0 or not batch-invariant here; float: the float head in the plan's dtype)")
    from hal.launch.config import ROW_CODES
    ap.add_argument("--row-codes", default="auto", choices=ROW_CODES,
                    help="a q4q8 plan's rows: int8 codes per input (auto: 1, llama.cpp's int8 rows, for a file with "
                         "K-quant tensors, else 2; 2: a value and its residual, about 15 bits, half the verify speed "
                         "on compute-bound shapes)")
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
    """``--draft``: a kind of `hal.drafters.kinds.DRAFT_KINDS`, its path existing where it names one."""
    try:
        spec = parse_draft(value)
    except HalError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--draft: ")) from None
    if spec.path is not None and not os.path.exists(spec.path):
        raise argparse.ArgumentTypeError(f"expected an existing path after {spec.kind}:, got {spec.path!r} "
                                         "(no such file or folder)")
    return value


class _Explicit(argparse.Action):
    """Stores a flag that ``--speculative-config`` also sets, and remembers it was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "speculative_config", None) is not None:
            parser.error(f"argument {option_string}: not allowed with --speculative-config, which sets it")
        setattr(namespace, self.dest, values)
        namespace._explicit = getattr(namespace, "_explicit", set()) | {self.dest}


class _Speculative(argparse.Action):
    """``--speculative-config``: sets ``draft`` and ``k`` (`hal.launch.spec_config`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from hal.checks import MAX_K
        from hal.launch.spec_config import parse_speculative_config
        given = sorted(getattr(namespace, "_explicit", set()) & {"draft", "k"})
        if given:
            parser.error(f"argument {option_string}: not allowed with --{given[0]}, which it sets")
        try:
            cfg = parse_speculative_config(values, MAX_K)
            namespace.draft = draft_flag(cfg.draft)
        except (HalError, argparse.ArgumentTypeError) as e:
            parser.error(f"argument {option_string}: {str(e).removeprefix('--speculative-config ')}")
        if cfg.k is not None:
            namespace.k = cfg.k
        namespace.speculative_config = values


def bounded(kind, lo=None, hi=None, lo_open: bool = False, finite: bool = False):
    """An argparse type: ``kind`` within ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); ``finite``:
    not infinite either."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an int' if kind is int else 'a number'}, got {text!r}") \
                from None
        if finite and v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            span = f"{'>' if lo_open else '>='} {lo}" if hi is None else \
                f"in {'(' if lo_open else '['}{lo}, {hi}]" if lo is not None else f"<= {hi}"
            raise argparse.ArgumentTypeError(f"expected a value {span}, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


def nonempty(text: str) -> str:
    """An argparse type: a string with something in it besides white space."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty name, got {text!r}")
    return text


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The flags every target entry point shares (names as vLLM's where one exists); a bad
    value or a missing path is refused by argparse (exit 2, naming the flag) before loading."""
    from hal.checks import MAX_K
    add_dtype_args(ap)
    ap.add_argument("--draft", default="ngram", type=draft_flag, action=_Explicit, help=draft_help())
    ap.add_argument("--model", default="smollm2-135m", type=model_flag,
                    help="a fetchable name, a .gguf path or an HF folder")
    ap.add_argument("--k", type=bounded(int, 0, MAX_K), default=8, action=_Explicit,
                    help=f"the cap on k per request and step (0..{MAX_K}); k itself with --no-route")
    ap.add_argument("--speculative-config", metavar="JSON", action=_Speculative,
                    help="vLLM's form of --draft and --k, e.g. '{\"method\": \"dspark\", "
                         "\"num_speculative_tokens\": 7}' (hal.launch.spec_config: method, "
                         "num_speculative_tokens, model; not with --draft or --k)")
    ap.add_argument("--route", action=argparse.BooleanOptionalAction, default=True,
                    help="the router chooses k (0 included) per request and step from the costs profiled at "
                         "start-up and the measured acceptance (the default); --no-route: a fixed k every step")
    ap.add_argument("--draft-startup-timeout", type=bounded(float, 0, lo_open=True), default=60.0,
                    help="seconds the target waits for the draft worker to join and send its first drafts; "
                         "then it serves alone by plain decoding")
    ap.add_argument("--fanout", type=bounded(int, 0, 64), default=None,
                    help="a draft on another rank: branches it drafts ahead per request while the target "
                         "verifies (the likeliest verification outcomes; 0: none). Default 8, except for the "
                         "EAGLE head (--draft eagle), which drafts ahead from its own features only when this "
                         "asks; trees and the other heads never do")
    ap.add_argument("--push", action=argparse.BooleanOptionalAction, default=False,
                    help="a draft on another rank or thread: it also sends the branches it drafts ahead while the "
                         "target verifies, and a round whose every request was among them waits for no reply "
                         "(hal.distributed.remote; off by default: measured, see docs/benchmarks.md)")
    ap.add_argument("--draft-thread", choices=("auto", "on", "off"), default="auto",
                    help="a draft in the target's process: run it on its own thread, one round ahead (the draft "
                         "worker's speculation cache and --fanout; hal.distributed.local). auto, the default: where "
                         "the draft is on another device than the target; on: also on the same device (it then "
                         "shares its cores); off: drafting inline, every round")
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
    ap.add_argument("--placement-hit-rate", type=bounded(float, 0, 1), default=0.0,
                    help="HAL_PLACEMENT=auto: the share of rounds a draft on another rank answers from its "
                         "speculation cache (spec_cache_hits / (hits + misses) in /metrics); 0, the default, "
                         "scores another rank as paying its link and its drafting every round. Trees and the heads "
                         "other than eagle (ngram+eagle, eagle-tree, dspark) never draft ahead: they are scored at 0 "
                         "whatever this says")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the target KV of prompt blocks seen before, and their target features for a "
                         "drafter that reads them (default: on)")

