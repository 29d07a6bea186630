"""Ad hoc: open chat, where does routed ngram+eagle lose? plain / routed / routed never drafting (shadow only) / routed without shadow."""
import sys, time, statistics, torch
from dataclasses import replace
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import hal
from benchmarks.e2e import PROMPTS
from hal.drafters.kinds import make_drafter, parse_draft
from hal.engine import Request
from hal.engine.costs import profile_costs
from hal.launch.build import build_engine, target_pool
from hal.models.fetch import fetch
from hal.models.loaders import load_gguf
from hal.models.tokenizer import chatml
torch.set_num_threads(2)
head = sys.argv[1]; draft = "ngram+eagle"
path, be = fetch("smollm2-135m"), hal.get_backend("cpu")
chosen = load_gguf(path, be, "auto")[0].plan
m, tok = load_gguf(path, be, plan=replace(chosen, head=head))
with torch.inference_mode():
    costs = profile_costs(m, make_drafter(parse_draft(draft), be, m, "smollm2-135m"), target_pool(m, 256))
    ids = tok.encode(chatml(PROMPTS[int(sys.argv[2]) if len(sys.argv) > 2 else 3][2])).ids
    modes = ("plain", "routed", "never", "noshadow")
    t = {n: [] for n in modes}; steps = {n: [] for n in modes}
    for rep in range(5):
        for n in modes:
            drafter = None if n == "plain" else make_drafter(parse_draft(draft), be, m, "smollm2-135m")
            dec = build_engine(m, drafter, k=8, route=drafter is not None, costs=costs, num_blocks=256)
            if n == "never":
                oc = dec.router.choose
                dec.router.choose = lambda states, budget=None, oc=oc: [0] * len(oc(states, budget))
            if n == "noshadow":
                dec.router.shadow = False; dec.router.evidence = 0
            s = time.perf_counter()
            out = dec.generate([Request(ids, max_new_tokens=64, k=8 if drafter else 0, stop_ids=(2,))])[0]
            dt = time.perf_counter() - s
            if rep: t[n].append(len(out) / dt)
    med = {n: statistics.median(v) for n, v in t.items()}
    print(" ".join(f"{n} {v:.1f} ({v/med['plain']:.2f})" for n, v in med.items()))
