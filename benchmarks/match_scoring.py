"""What scoring a lookup match costs: on the host (`hal.engine.router.Router.guess`, since stop 83)
against the decoder's score on the device (``device``: the same router with ``guess`` refused, so
every match the router scores has its first draft built into a proposal, moved, and compared with
the emitted token, or for a sampled request scored as p(draft) under a second softmax of the row, as
before stop 83; here at stop 83's cadence, every matched step). Routed ``--mode`` engines (k <= 6)
against plain decoding, stepped in turn so a busy spell of a shared machine lands on all of them:

* ``alone``: one greedy open-ended request per engine (``--alone-tokens`` each, the first 3 steps
  not counted), four engines in turn: plain, host, device and a second plain one (the noise floor);
* ``batch``: ``--batch`` sampled requests at a time (temperature 0.7, a seed per request, refilled
  as they finish, ``--batch-tokens`` each) over open-ended prompts, plain, host, device and a second
  plain engine stepped in turn, each engine its own requests (the same seeds).

Reported per engine and kind of step (drafted, scored on the device, scored on the host, neither)
at the full batch: the steps counted and their median time over the plain engine's median step,
and, for ``batch``, each engine's total step time over plain's (a second plain engine's: the noise
floor). A kind of step is not a position: matched steps come later in a request, at longer contexts,
than the steps of its start, so compare the engines' rows of one kind, not a row with plain's.
Greedy outputs of the host and device routers are checked to be the same.

    python benchmarks/match_scoring.py [--mode ngram] [--rounds 3] [--alone-tokens 192] [--batch 4]
        [--batch-tokens 64] [--out benchmarks/results/match-scoring.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from defaults import OPEN as TUNED  # noqa: E402
from routing import OPEN, bundled, publish  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="ngram")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--alone-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be, model, tok, template = bundled(tempfile.mkdtemp(prefix="hal-route-memory-"))
    from hal.cli import measured_costs
    from hal.launch.build import cli_drafter
    from hal.models.machine import machine_line
    from hal.models.tokenizer import prompt_ids
    costs = measured_costs(model, cli_drafter(args.mode, model, be), max_tokens=7)
    ids = lambda p: prompt_ids(tok, template, p)   # noqa: E731
    alone = run_alone(model, be, args, costs, [ids(p + " Take your time and go into detail.") for p in OPEN[:3]])
    batch = run_batch(model, be, args, costs, [ids(p) for p in OPEN + TUNED])
    write(args, alone, batch, machine_line(model.plan))


def engines(model, be, mode, costs, names, batch, tokens):
    """Plain engines for names starting with ``plain``, routed ``mode`` ones for the others; the
    ``device`` one's router scores matches as the decoder did before stop 83."""
    from hal.engine.router import Router
    from hal.launch.build import build_engine, cli_drafter, local_pool

    class OnDevice(Router):
        def guess(self, state):
            return False

    out = {}
    for name in names:
        drafter = None if name.startswith("plain") else cli_drafter(mode, model, be)
        out[name] = build_engine(model, drafter, k=6, route=drafter is not None, costs=costs,
                                 pool=local_pool(model, batch, 1024 + tokens, 6))
        if name == "device":
            out[name].router.__class__ = OnDevice
    return out


def kind_of(engine, out) -> str:
    r = engine.router
    if r is None:
        return "plain"
    return "drafted" if sum(out.k.values()) else "scored on the device" if r.scored else \
        "scored on the host" if r.guesses else "neither"


def run_alone(model, be, args, costs, prompts):
    from hal.engine import Request
    t, outs = defaultdict(list), defaultdict(list)
    for _ in range(args.rounds):
        for ids in prompts:
            es = engines(model, be, args.mode, costs, ["plain", "host", "device", "plain2"], 1, args.alone_tokens)
            for name, e in es.items():
                e.add(Request(ids, max_new_tokens=args.alone_tokens, k=0 if name.startswith("plain") else 6))
            order, i, got = list(es.items()), 0, defaultdict(list)
            while any(e.has_unfinished() for e in es.values()):
                for name, e in order[i % 4:] + order[:i % 4]:   # the order rotated step by step
                    if not e.has_unfinished():
                        continue
                    t0 = time.perf_counter()
                    out = e.step()
                    dt = time.perf_counter() - t0
                    for toks in out.tokens.values():
                        got[name].extend(toks)
                    if i >= 3:
                        t[(name, kind_of(e, out))].append(dt)
                i += 1
            for name in es:
                outs[name].append(got[name])
    return t, outs["host"] == outs["device"] == outs["plain"]


def run_batch(model, be, args, costs, prompts):
    from hal.engine import Request
    names = ["plain", "host", "device", "plain2"]
    t, total = defaultdict(list), defaultdict(float)
    for rnd in range(args.rounds):
        es = engines(model, be, args.mode, costs, names, args.batch, args.batch_tokens)
        pending = {name: [Request(p, max_new_tokens=args.batch_tokens, temperature=0.7, seed=100 * rnd + i,
                                  k=0 if name.startswith("plain") else 6) for i, p in enumerate(prompts)]
                   for name in names}
        i = 0
        while any(pending[name] or es[name].has_unfinished() for name in names):
            for name in names[i % 4:] + names[:i % 4]:   # the order rotated step by step
                e, s = es[name], es[name].scheduler
                if not (pending[name] or e.has_unfinished()):
                    continue
                while pending[name] and len(s.running) + len(s.prefilling) + len(s.waiting) < args.batch:
                    e.add(pending[name].pop(0))
                t0 = time.perf_counter()
                out = e.step()
                dt = time.perf_counter() - t0
                total[name] += dt
                if len(out.k) == args.batch:
                    t[(name, kind_of(e, out))].append(dt)
            i += 1
    return t, total


def table(t, floor_names) -> list[str]:
    plain = statistics.median(t[("plain", "plain")])
    lines = ["| engine | step | steps | median step / plain's |", "|---|---|---|---|"]
    for (name, kind), v in sorted(t.items()):
        if name.startswith("plain") and name not in floor_names:
            continue
        lines.append(f"| {name} | {kind} | {len(v)} | {statistics.median(v) / plain:.3f} |")
    return lines + ["", f"Plain step median: {plain * 1e3:.2f} ms."]


def write(args, alone, batch, machine):
    cmd = "python benchmarks/match_scoring.py " + " ".join(sys.argv[1:])
    (ta, same), (tb, total) = alone, batch
    lines = [f"# Scoring a lookup match on the host against the device, {time.strftime('%Y-%m-%d')}", "",
             f"Command: `{cmd}`. {machine}. Bundled SmolLM2-135M (GGUF Q4_1), `{args.mode}` routed (k <= 6), "
             f"{args.rounds} rounds.", "",
             f"## One greedy request ({args.alone_tokens} tokens, 3 open-ended prompts), four engines in turn", ""]
    lines += table(ta, ("plain2",))
    lines += ["", f"Greedy outputs of plain, host and device equal: {same}.", "",
              f"## {args.batch} sampled requests at a time (T=0.7, {args.batch_tokens} tokens each, "
              f"{len(OPEN) + len(TUNED)} open-ended prompts a round), steps at the full batch", ""]
    lines += table(tb, ("plain2",))
    lines += ["", "Total time over plain's: " + ", ".join(f"{n} {total[n] / total['plain']:.3f}" for n in total) + "."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
