"""Does routed speculation ever cost more than plain decoding? Each routed mode (k <= 6, the
router's defaults) against plain decoding on the bundled model, in one run, interleaved:

* prompt groups: ``open`` (open-ended prompts written for this benchmark, none of them the
  demo's or benchmarks/defaults.py's, which routing was tuned on) and ``copy`` (the
  copy-heavy prompts of benchmarks/e2e.py);
* greedy and sampled (temperature 0.7, a seed per request);
* ``fresh``: a new engine per request, over costs profiled once per mode (as ``spec-hal
  generate`` runs), restoring what earlier engines kept (`hal.engine.route_memory`, in an
  empty folder made for this run and first written by ``--warm`` requests per mode on
  defaults.py's open prompts, as a user's earlier commands would);
* ``persistent``: one engine per mode for every request (as ``spec-hal serve`` runs).

For each request and mode (the modes' order rotated request by request), plain and routed run
alternately ``--reps`` times and each keeps its least time (a busy spell of a shared machine
only adds time); only ``generate`` is timed (engine building is not). Reported: routed over
plain tokens per second, geometric mean per mode, engine, temperature and group over the
prompts and ``--rounds`` rounds; greedy outputs are checked to equal plain's. Then the cost of a routed step that
drafts and scores nothing: routed and plain engines stepped in turn on one long
open-ended request, the median of the routed engine's steps with k = 0 and nothing scored
(on the device or, a lookup match's, on the host: `Router.guess`) over the median plain step
(all steps after the first 3, over ``--rounds`` rounds), beside the same for a router without
quiet spells (`hal.engine.route_cadence`: every step walks) and for a second plain engine (the
noise floor), all four stepped in turn; and the host's time outside the forward in such a step,
routed and plain (routing's own work per step, free of the forward's noise). ``--steps-only``:
that table alone.

    python benchmarks/routing.py [--modes ngram,ngram+eagle,ngram+dspark,dspark] [--rounds 1] [--reps 3]
        [--max-tokens 64] [--warm 4] [--steps-only] [--out benchmarks/results/routing.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from defaults import OPEN as TUNED  # noqa: E402
from e2e import PROMPTS  # noqa: E402

OPEN = ["Describe how a bicycle works.", "What are the benefits of learning a second language?",
        "Write a haiku about winter mornings.", "Suggest a name for a coffee shop and explain why.",
        "How can I stay focused while working from home?", "Invent a short detective story and summarise its plot."]
COPY = [p for _, kind, p in PROMPTS if kind == "copy"]
GROUPS = {"open": OPEN, "copy": COPY}
TEMPS = (0.0, 0.7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="ngram,ngram+eagle,ngram+dspark,dspark")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="plain/routed alternations per request and mode (least time)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warm", type=int, default=4, help="requests per mode that fill the route memory first")
    ap.add_argument("--step-tokens", type=int, default=192, help="tokens of the step-overhead request")
    ap.add_argument("--steps-only", action="store_true", help="only the cost of a step that drafts nothing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be, model, tok, template = bundled(tempfile.mkdtemp(prefix="hal-route-memory-"))
    from hal.cli import measured_costs
    from hal.launch.build import cli_drafter
    from hal.models.machine import machine_line
    from hal.models.tokenizer import prompt_ids
    modes = args.modes.split(",")
    costs = {m: measured_costs(model, cli_drafter(m, model, be), max_tokens=7) for m in modes}
    ids = lambda p: prompt_ids(tok, template, p)   # noqa: E731
    for m in modes:   # what earlier commands left in the route memory
        for p in TUNED[:0 if args.steps_only else args.warm]:
            run_fresh(model, be, m, costs[m], ids(p), 0.0, args.max_tokens, 0)
    persistent = {m: engine(model, be, m, costs.get(m), args.max_tokens) for m in ["none", *modes]}
    times = {}   # (mode, engine, temp, group) -> list of (routed tok/s / plain tok/s)
    same = {m: [0, 0] for m in modes}
    n = 0
    for rnd in range(0 if args.steps_only else args.rounds):
        for temp in TEMPS:
            for group, prompts in GROUPS.items():
                for i, p in enumerate(prompts):
                    seed = 1000 * rnd + i
                    order = modes[n % len(modes):] + modes[:n % len(modes)]
                    n += 1
                    for kind in ("fresh", "persistent"):
                        for m in order:   # plain and routed alternately, the least time of each
                            tp = ts = math.inf
                            for _ in range(args.reps):
                                dec = persistent["none"] if kind == "persistent" else engine(
                                    model, be, "none", None, args.max_tokens)
                                plain, t = run(dec, ids(p), temp, args.max_tokens, seed, 0)
                                tp = min(tp, t)
                                dec = persistent[m] if kind == "persistent" else engine(
                                    model, be, m, costs[m], args.max_tokens)
                                out, t = run(dec, ids(p), temp, args.max_tokens, seed, 6)
                                ts = min(ts, t)
                            times.setdefault((m, kind, temp, group), []).append((len(out) / ts) / (len(plain) / tp))
                            if temp == 0:
                                same[m][0] += out == plain
                                same[m][1] += 1
    steps = {m: step_overhead(model, be, m, costs[m], ids(OPEN[0] + " Take your time and go into detail."),
                              args.step_tokens, args.rounds) for m in modes}
    write(args, modes, times, same, steps, machine_line(model.plan))


def bundled(route_memory: str):
    """(backend, model, tokenizer, chat template) of the bundled SmolLM2-135M on 2 threads, with
    ``HAL_ROUTE_MEMORY`` set to ``route_memory`` first (before any engine is built)."""
    os.environ["HAL_ROUTE_MEMORY"] = route_memory
    import hal
    from hal.models.fetch import load_model, model_path
    from hal.models.tokenizer import chat_template_of
    torch.set_num_threads(2)
    be = hal.get_backend()
    model, tok = load_model("smollm2-135m", be, "auto")
    return be, model, tok, chat_template_of(model_path("smollm2-135m"))


def engine(model, be, mode, costs, max_tokens):
    from hal.launch.build import build_engine, cli_drafter, local_pool
    drafter = None if mode == "none" else cli_drafter(mode, model, be)
    return build_engine(model, drafter, k=6, route=drafter is not None, costs=costs,
                        pool=local_pool(model, 1, 1024 + max_tokens, 6))


def run(dec, ids, temp, max_tokens, seed, k):
    from hal.engine import Request
    req = Request(ids, max_new_tokens=max_tokens, temperature=temp, seed=seed, k=k)
    t = time.perf_counter()
    out = dec.generate([req])[0]
    return out, time.perf_counter() - t


def run_fresh(model, be, mode, costs, ids, temp, max_tokens, seed):
    return run(engine(model, be, mode, costs, max_tokens), ids, temp, max_tokens, seed, 6)


def step_overhead(model, be, mode, costs, ids, tokens, rounds):
    """(median routed step with nothing drafted or scored / median plain step, the same for a
    router without quiet spells (``spell = 0``: every step walks), and for a second plain engine
    (the noise floor: two identical engines differ this much), routed steps counted, median plain
    step, and the host's time outside the model's forward (`hal.engine.execution.execute`) in a
    routed step that drafts nothing and in a plain step, medians). The four engines step in turn,
    the order rotated step by step."""
    from hal.engine import Request
    t = {"plain": [], "routed": [], "walking": [], "plain2": []}
    host = {"plain": [], "routed": []}   # step time less the forward's: routing's own work shows here
    for _ in range(rounds):
        engines = {"plain": engine(model, be, "none", None, tokens), "routed": engine(model, be, mode, costs, tokens),
                   "walking": engine(model, be, mode, costs, tokens), "plain2": engine(model, be, "none", None, tokens)}
        engines["walking"].router.spell = 0
        for name, e in engines.items():
            e.add(Request(ids, max_new_tokens=tokens, k=0 if name.startswith("plain") else 6))
        order, i = list(engines.items()), 0
        with ForwardTimer() as forward:
            while any(e.has_unfinished() for e in engines.values()):
                for name, e in order[i % 4:] + order[:i % 4]:
                    if not e.has_unfinished():
                        continue
                    forward.seconds, t0 = 0.0, time.perf_counter()
                    out = e.step()
                    dt = time.perf_counter() - t0
                    drafts_nothing = e.router is None or not sum(out.k.values()) and not e.router.scored
                    if i >= 3 and drafts_nothing and (e.router is None or not e.router.guesses):
                        t[name].append(dt)
                    if i >= 3 and drafts_nothing and name in host:
                        host[name].append(dt - forward.seconds)
                i += 1
    plain = statistics.median(t["plain"])
    return (statistics.median(t["routed"]) / plain, statistics.median(t["walking"]) / plain,
            statistics.median(t["plain2"]) / plain, len(t["routed"]), plain,
            statistics.median(host["routed"]), statistics.median(host["plain"]))


class ForwardTimer:
    """Times `hal.engine.execution.execute` (the step's forward, sampling and verification) as the
    decoder calls it, less the lookahead drafting it does (`hal.engine.proposals.lookahead`: host
    work of a drafter), into ``seconds``, while entered; a benchmark's instrument, restored on exit."""

    def __enter__(self):
        import hal.engine.decoder as decoder
        import hal.engine.proposals as proposals
        self.seconds, self.saved = 0.0, [(decoder, "execute", decoder.execute),
                                         (proposals, "lookahead", proposals.lookahead)]
        for module, name, inner in self.saved:
            setattr(module, name, self._timed(inner, 1 if name == "execute" else -1))
        return self

    def _timed(self, inner, sign: int):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += sign * (time.perf_counter() - t0)
        return timed

    def __exit__(self, *exc):
        for module, name, inner in self.saved:
            setattr(module, name, inner)


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def write(args, modes, times, same, steps, machine):
    cmd = "python benchmarks/routing.py " + " ".join(sys.argv[1:])
    lines = [f"# Routed modes against plain decoding, {time.strftime('%Y-%m-%d')}", "",
             f"Command: `{cmd}`. {machine}. Bundled SmolLM2-135M (GGUF Q4_1), k <= 6 routed, "
             f"{args.max_tokens} new tokens, {args.rounds} rounds of {args.reps} alternations (least time each), route memory warmed by {args.warm} requests "
             "per mode. Ratio: routed tokens per second over plain's on the same request, geometric mean "
             f"over the prompts ({len(OPEN)} open-ended held-out, {len(COPY)} copy-heavy) and rounds.", "",
             "| mode | engine | " + " | ".join(f"{g} {'greedy' if t == 0 else 'T=0.7'}" for t in TEMPS
                                             for g in GROUPS) + " |",
             "|---|---|" + "---|" * (len(TEMPS) * len(GROUPS))]
    for m in modes if not args.steps_only else ():
        for kind in ("fresh", "persistent"):
            cells = [f"{geomean(times[(m, kind, t, g)]):.3f}x" for t in TEMPS for g in GROUPS]
            lines.append(f"| {m} | {kind} | " + " | ".join(cells) + " |")
    lines += ["", "Greedy outputs equal plain's: " + ", ".join(f"{m} {a}/{b}" for m, (a, b) in same.items()) + "."]
    if args.steps_only:   # no request was run: the cost of a step that drafts nothing alone
        lines = lines[:2] + [f"Command: `{cmd}`. {machine}. Bundled SmolLM2-135M (GGUF Q4_1), k <= 6 routed, "
                             f"{args.rounds} rounds."]
    lines += ["", "A routed step that drafts and scores nothing, against a plain step (interleaved step by step on "
              f"one open-ended request of {args.step_tokens} tokens; medians):", "",
              "| mode | routed k=0 step / plain step | without quiet spells / plain step | a second plain engine / "
              "plain step | routed steps measured | plain step | host outside the forward: routed k=0 step, plain "
              "step (µs) | the difference / plain step |", "|---|---|---|---|---|---|---|---|"]
    for m, (ratio, walking, floor, count, plain, host_r, host_p) in steps.items():
        lines.append(f"| {m} | {ratio:.3f} | {walking:.3f} | {floor:.3f} | {count} | {plain * 1e3:.2f} ms | "
                     f"{host_r * 1e6:.0f}, {host_p * 1e6:.0f} | {(host_r - host_p) / plain * 100:+.2f}% |")
    lines += ["", "Host outside the forward: a step's time less `hal.engine.execution.execute`'s (the forward, "
              "sampling and verification) but for the drafting ahead it runs (`hal.engine.proposals.lookahead`, "
              "host work), over the routed engine's steps that drafted nothing (its match scored on the host or "
              "not) and the plain engine's; the difference is routing's own host work per step."]
    publish(lines, args.out)


def publish(lines: list[str], out: str | None) -> None:
    """Print a result's lines, and write them to ``out`` where given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
