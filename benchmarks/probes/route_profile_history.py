"""Ad hoc: routed ngram+eagle with the drafter profiled on one repeated token (before) vs distinct ids (after)."""
import sys, time, statistics, torch
from dataclasses import replace
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import hal
import hal.engine.router as R
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
costs = {}
with torch.inference_mode():
    for name, toks in (("ones", (1,) * 16), ("distinct", R.PROFILE_TOKENS)):
        saved = R.PROFILE_TOKENS; R.PROFILE_TOKENS = toks
        costs[name] = profile_costs(m, make_drafter(parse_draft(draft), be, m, "smollm2-135m"), target_pool(m, 256))
        R.PROFILE_TOKENS = saved
        print(name, {k: round(v * 1e3, 2) for k, v in costs[name].draft.items()})
    for label, _, text in PROMPTS:
        ids = tok.encode(chatml(text)).ids
        t = {n: [] for n in ("plain", "ones", "distinct")}
        ref = None
        for rep in range(4):
            for n in t:
                drafter = None if n == "plain" else make_drafter(parse_draft(draft), be, m, "smollm2-135m")
                dec = build_engine(m, drafter, k=8, route=drafter is not None, costs=costs.get(n, costs["ones"]), num_blocks=256)
                s = time.perf_counter()
                out = dec.generate([Request(ids, max_new_tokens=64, k=8 if drafter else 0, stop_ids=(2,))])[0]
                dt = time.perf_counter() - s
                ref = ref or out
                assert out == ref
                if rep: t[n].append(len(out) / dt)
        med = {n: statistics.median(v) for n, v in t.items()}
        print(f"| {label} | {med['plain']:.1f} | {med['ones']:.1f} | {med['distinct']:.1f} | {med['ones']/med['plain']:.2f} | {med['distinct']/med['plain']:.2f} | {med['distinct']/med['ones']:.2f} |", flush=True)
