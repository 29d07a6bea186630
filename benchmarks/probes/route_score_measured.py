"""Ad hoc: a drafter routed under the rules before stop 59 ("before": a shadow drafter's greedy
first drafts at k = 0 scored on every step, other drafters' idle requests probed every 16 steps)
against the measured ones (`Router.score_every`, `Router._probe_interval`), with plain decoding,
on the open prompts of benchmarks/defaults.py, modes interleaved batch by batch.

    python benchmarks/probes/route_score_measured.py [--rounds 3] [--batches 1,4] [--draft eagle]
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


class Before(routing.Router):
    """The rules before stop 59: a greedy request at k = 0 scored on every step (with QUIET set out
    of reach), an idle one probed every ``probe_every`` steps."""
    score_every = property(lambda self: 1)

    def _probe_interval(self, states, ks, caps):
        return self.probe_every


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
    decs["before"] = build_engine(target, make_drafter(parse_draft(args.draft), target.be, target,
                                                           "smollm2-135m"), k=7, route=True, costs=costs)
    old = decs["before"].router
    decs["before"].router = Before(costs, max_k=old.max_k, probe_every=old.probe_every, shadow=old.shadow)
    print(machine_line(target.plan))
    for b in map(int, args.batches.split(",")):
        tot = {n: [0, 0.0] for n in decs}
        outs = {}
        for r in range(args.rounds):
            for i in range(0, len(ids), b):
                for name, dec in decs.items():
                    routing.QUIET = 10 ** 9 if name == "before" else 8
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
