"""Ad hoc: the EAGLE head routed, its greedy first drafts at k = 0 scored on every step (the rule
before stop 59) against every `Router.score_every` steps (measured), with plain decoding, on the
open prompts of benchmarks/defaults.py at batch 1 and 4, modes interleaved batch by batch.

    python benchmarks/probes/route_score_measured.py [--rounds 3] [--batches 1,4]
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from defaults import OPEN  # noqa: E402

import hal  # noqa: E402
from hal.drafters.kinds import make_drafter, parse_draft  # noqa: E402
from hal.engine import router as routing  # noqa: E402
from hal.engine.requests import Request  # noqa: E402
from hal.launch.build import build_engine  # noqa: E402
from hal.models.fetch import load_model  # noqa: E402
from hal.models.machine import machine_line  # noqa: E402
from hal.models.tokenizer import chatml  # noqa: E402


class EveryStep(routing.Router):
    """The rule before stop 59: a greedy request at k = 0 scored on every step."""
    score_every = property(lambda self: 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--draft", default="eagle")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    stop = target.cfg.stop_ids
    ids = [tok.encode(chatml(p)).ids for p in OPEN]
    decs = {"plain": build_engine(target, None)}
    decs["measured"] = build_engine(target, make_drafter(parse_draft(args.draft), target.be, target, "smollm2-135m"),
                                    k=7, route=True)
    costs = decs["measured"].router.costs
    decs["every step"] = build_engine(target, make_drafter(parse_draft(args.draft), target.be, target,
                                                           "smollm2-135m"), k=7, route=True, costs=costs)
    old = decs["every step"].router
    decs["every step"].router = EveryStep(costs, max_k=old.max_k, probe_every=old.probe_every, shadow=old.shadow)
    print(machine_line(target.plan))
    for b in map(int, args.batches.split(",")):
        tot = {n: [0, 0.0] for n in decs}
        outs = {}
        for r in range(args.rounds):
            for i in range(0, len(ids), b):
                for name, dec in decs.items():
                    routing.QUIET = 10 ** 9 if name == "every step" else 8
                    t = time.perf_counter()
                    got = dec.generate([Request(p, max_new_tokens=64, k=0 if name == "plain" else 7, stop_ids=stop)
                                        for p in ids[i:i + b]])
                    tot[name][0] += sum(map(len, got))
                    tot[name][1] += time.perf_counter() - t
                    outs.setdefault((r, i), []).append(got)
        assert all(o[0] == x for o in outs.values() for x in o), "outputs differ"
        plain = tot["plain"][0] / tot["plain"][1]
        for name, (n, s) in tot.items():
            extra = f", score_every {decs[name].router.score_every}" if name == "measured" else ""
            print(f"batch {b} | {name} | {n / s:.1f} tok/s | {n / s / plain:.2f}x plain{extra}", flush=True)


if __name__ == "__main__":
    main()
