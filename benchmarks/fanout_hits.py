"""How wide the draft worker's fan-out must be for issue 36's hit rate (>= 70% of rounds), and
whether that fits a worker of one core: the EAGLE head and a draft model (the target's first 8
layers) on the open-ended prompts (`benchmarks/defaults.py`'s OPEN), greedy, k fixed.

The engine verifies k drafts per round as the remote path does; its drafter is asked for k + 1
slots with each slot's N likeliest tokens (`DraftBatch.alternatives`; the extra slot is the
extension's guess, `hal.distributed.speculate`), and each round's outcome (a, b) is read from the
next round's history. Offline, `FanOut`'s ranking is replayed on those records with no time
limit: branches (a, b) for a < k from the slot's alternatives other than its draft, scored
alpha^a (1 - alpha) p / rest, and the extension at alpha^k, whose guess's alternatives follow at
alpha^k p (alpha: the request's acceptance so far, (accepted + 1) / (tried + 2)). A round hits at
budget B when its outcome is among its B best branches; F is the alternatives per slot. The
worker can draft the B that fit in the round's verify window: the head's chain of k per branch
against the target's forward over k + 1 tokens plus the round trip, profiled here at the same
thread count (one thread: the 1 + 1 core case), one branch per drafter call as the worker does.
The tokens/s ratio is the pushed-offers model (V + D) / (V + (1 - h)(D + RTT)): a ceiling.

    python benchmarks/fanout_hits.py [--drafts eagle,self:8] [--k 3] [--max-new-tokens 64] [--alternatives 32]
                                     [--threads 1] [--rtt-ms 1]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

import hal
from defaults import OPEN
from hal.drafters.kinds import make_drafter, parse_draft
from hal.engine import SpeculativeDecoder
from hal.engine.drafting import DraftBatch, Proposal, capabilities
from hal.engine.requests import Request
from hal.launch.build import build_engine
from hal.models.fetch import load_model
from hal.models.machine import machine_line
from hal.models.tokenizer import chatml

BUDGETS = (1, 2, 4, 8, 16, 32, 64)


class Recorder:
    """The head, asked for one slot more than the engine verifies and for each slot's
    alternatives; keeps (drafts, alternatives) per round and reads its outcome next round."""

    def __init__(self, head, alternatives: int):
        self.head, self.n, self.be = head, alternatives, capabilities(head).be
        self.features = getattr(head, "features", None)
        self.rounds: list[tuple[int, int, int, list[int], list[list[tuple[int, float]]]]] = []
        self.sent: dict[int, tuple[int, list[int], list]] = {}

    def propose(self, b: DraftBatch) -> Proposal:
        for i, rid in enumerate(b.rids):   # round r's outcome: the history grew by d[:a] + [b]
            if rid in self.sent:
                start, drafts, alts = self.sent.pop(rid)
                grown = b.history[i, start:b.lengths[i]].tolist()
                a = next((j for j, (x, y) in enumerate(zip(drafts, grown)) if x != y), min(len(drafts), len(grown)))
                if a < len(grown):
                    self.rounds.append((rid, a, grown[a], drafts, alts))
        wide = self.head.propose(replace(b, k=tuple(k + 1 if k else 0 for k in b.k), alternatives=self.n))
        cu_w, cu, keep = 0, [0], []
        ids, top, p = wide.draft_token_ids.tolist(), wide.top_ids.tolist(), wide.top_probs.tolist()
        for rid, k, length in zip(b.rids, b.k, b.lengths):
            if k:
                alts = [list(zip(top[j], p[j])) for j in range(cu_w, cu_w + k + 1)]
                self.sent[rid] = (length, ids[cu_w:cu_w + k], alts)
                keep += range(cu_w, cu_w + k)
                cu_w += k + 1
            cu.append(cu[-1] + k)
        return Proposal(draft_token_ids=wide.draft_token_ids[torch.tensor(keep, dtype=torch.long)],
                        cu_num_draft_tokens=torch.tensor(cu))

    def commit(self, rids, kept) -> None:
        self.head.commit(rids, kept)

    def release(self, rid) -> None:
        self.sent.pop(rid, None)
        self.head.release(rid)


def ranked(a_k: int, drafts: list[int], alts, alpha: float, F: int) -> list[tuple[int, int]]:
    """The outcomes (a, b) in the order `FanOut` drafts them, as far as B could reach."""
    heap = []
    for a in range(a_k):
        other = [(t, p) for t, p in alts[a][:F + 1] if t != drafts[a]]
        rest = sum(p for _, p in other) or 1.0
        heap += [(alpha ** a * (1 - alpha) * p / rest, (a, t)) for t, p in other[:F]]
    ext = alpha ** a_k
    guess = alts[a_k][0][0]
    heap.append((ext, (a_k, guess)))
    heap += [(ext * p, (a_k, t)) for t, p in alts[a_k][:F + 1] if t != guess]   # after the extension is drafted
    return [o for _, o in sorted(heap, key=lambda x: -x[0])]


def hit_rates(rounds, F: int) -> dict[int, float]:
    hits, seen = {b: 0 for b in BUDGETS}, {}
    for rid, a, tok, drafts, alts in rounds:
        acc, tried = seen.get(rid, (0, 0))
        order = ranked(len(drafts), drafts, alts, (acc + 1) / (tried + 2), F)   # fewer than k near the end
        where = order.index((a, tok)) if (a, tok) in order else None
        for b in BUDGETS:
            hits[b] += where is not None and where < b
        seen[rid] = (acc + a, tried + a + (a < len(drafts)))
    return {b: h / max(1, len(rounds)) for b, h in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="eagle,self:8", help="drafters, comma-separated (--draft kinds)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--alternatives", type=int, default=32, help="N: tokens recorded per slot")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rtt-ms", type=float, default=1.0)
    ap.add_argument("--out", default="benchmarks/results/fanout-hits.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = load_model("smollm2-135m", hal.get_backend("cpu"), "auto")
    lines = ["# The draft worker's fan-out: hit rate against its width (issue 36)", "",
             f"`python benchmarks/fanout_hits.py --drafts {args.drafts} --k {args.k} --max-new-tokens "
             f"{args.max_new_tokens} --alternatives {args.alternatives} --threads {args.threads} --rtt-ms "
             f"{args.rtt_ms:g}`; {machine_line(target.plan)}; {time.strftime('%Y-%m-%d')}; greedy, {len(OPEN)} "
             f"open-ended prompts at k = {args.k}."]
    for kind in args.drafts.split(","):
        lines += ["", *section(target, tok, kind, args)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def section(target, tok, kind: str, args) -> list[str]:
    """One drafter's table: its rounds recorded, its hit rates replayed, its costs profiled."""
    make = lambda: make_drafter(parse_draft(kind), target.be, target, "smollm2-135m")  # noqa: E731
    rec, k = Recorder(make(), args.alternatives), args.k
    with torch.inference_mode():
        build_engine(target, rec, k=k).generate([Request(tok.encode(chatml(p)).ids, max_new_tokens=args.max_new_tokens,
                                                         k=k, stop_ids=target.cfg.stop_ids) for p in OPEN])
        costs = SpeculativeDecoder(target, make(), num_blocks=256).profile_costs(max_tokens=k + 2, context=200, reps=9)
    V, D, rtt = costs.cost(k + 1, (k + 1) * 200, 0), costs.cost(0, 0, k), args.rtt_ms / 1000
    fit, rounds = int((V + rtt) // D), rec.rounds
    lines = [f"## `{kind}`: {len(rounds)} rounds, first drafts accepted in "
             f"{sum(r[1] > 0 for r in rounds) / max(1, len(rounds)):.0%}", "",
             "| alternatives per slot F | " + " | ".join(f"hits at B = {b}" for b in BUDGETS) + " |",
             "|---:|" + "---:|" * len(BUDGETS)]
    table = {F: hit_rates(rounds, F) for F in (3, 8, args.alternatives - 1)}
    lines += [f"| {F} | " + " | ".join(f"{t[b]:.0%}" for b in BUDGETS) + " |" for F, t in table.items()]
    h, best = max(((t[b], F) for F, t in table.items() for b in BUDGETS if b <= fit), default=(0.0, 3))
    return lines + ["", f"Profiled at {args.threads} thread(s): the target's forward over {k + 1} tokens (200 cached) "
                    f"V = {V * 1e3:.2f} ms, the drafter's chain of {k} D = {D * 1e3:.2f} ms; with a {args.rtt_ms:g} ms "
                    f"round trip {fit} branches fit in a window, one per drafter call, for a hit rate of {h:.0%} "
                    f"(F = {best}). Tokens/s remote over in-process, pushed offers, at that rate: (V + D) / (V + "
                    f"(1 - h)(D + RTT)) = {(V + D) / (V + (1 - h) * (D + rtt)):.2f}x; were every round a hit: "
                    f"{(V + D) / V:.2f}x."]


if __name__ == "__main__":
    main()
