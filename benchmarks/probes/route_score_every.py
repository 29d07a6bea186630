"""Ad hoc: greedy requests at k = 0 shadow-scored every step vs every Nth step (head drafters)."""
import sys, time, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import hal
from benchmarks.e2e import PROMPTS
from hal.drafters.kinds import make_drafter, parse_draft
from hal.engine import Request
from hal.engine.costs import profile_costs
from hal.engine.router import Router
from hal.launch.build import build_engine, target_pool
from hal.models.fetch import fetch
from hal.models.loaders import load_gguf
from hal.models.tokenizer import chatml
torch.set_num_threads(2)
draft = sys.argv[1]; every = int(sys.argv[2])
path, be = fetch("smollm2-135m"), hal.get_backend("cpu")
m, tok = load_gguf(path, be, "auto")
def keep(self, states, ks, caps, budget, every=every):
    self.scored = set()
    for i, state in enumerate(states):
        rid = state.rid
        self.idle[rid] = 0 if ks[i] else self.idle.get(rid, 0) + 1
        if ks[i] or not caps[i]:
            continue
        due = bool(self.probe_every) and self.idle[rid] >= self.probe_every
        if self.shadow and ((state.req.temperature == 0 and self.idle[rid] % every == 0) or due or not self._known(rid)):
            self.scored.add(rid)
            if due:
                self.idle[rid] = 0
        elif due and (budget is None or len(states) + sum(ks) < budget):
            ks[i], self.idle[rid] = 1, 0
orig = Router._keep_learning
with torch.inference_mode():
    costs = profile_costs(m, make_drafter(parse_draft(draft), be, m, "smollm2-135m"), target_pool(m, 256))
    for label, _, text in PROMPTS:
        ids = tok.encode(chatml(text)).ids
        modes = ("plain", "every1", f"every{every}")
        t = {n: [] for n in modes}; ref = None
        for rep in range(4):
            for n in modes:
                Router._keep_learning = orig if n == "every1" else keep
                drafter = None if n == "plain" else make_drafter(parse_draft(draft), be, m, "smollm2-135m")
                dec = build_engine(m, drafter, k=8, route=drafter is not None, costs=costs, num_blocks=256)
                s = time.perf_counter()
                out = dec.generate([Request(ids, max_new_tokens=64, k=8 if drafter else 0, stop_ids=(2,))])[0]
                dt = time.perf_counter() - s
                ref = ref or out; assert out == ref
                if rep: t[n].append(len(out) / dt)
        med = {n: statistics.median(v) for n, v in t.items()}
        print(label, " ".join(f"{n} {v:.1f} ({v/med['plain']:.2f})" for n, v in med.items()), flush=True)
