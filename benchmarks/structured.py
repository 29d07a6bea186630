"""Structured outputs on SmolLM2-135M (cpu): which grammar library, and what speculative
decoding buys under a JSON schema.

1. **Library** (llguidance against xgrammar, on this tokenizer and schema): matcher
   creation, and per token of a valid answer the work of one verify step of the engine:
   the mask, one draft consumed, the next mask, a rollback, the token consumed.
2. **Engine**: chat requests whose output follows a JSON schema (the schema is in the
   prompt, as users write them), greedy, each run alone: plain decoding, n-gram drafts at
   a fixed k, and routed n-gram drafts, interleaved prompt by prompt. Outputs must be
   identical to plain; the ratio is total plain time / total speculative time.

    python benchmarks/structured.py [--prompts 6] [--max-tokens 160] [--k 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hal
from report import publish
from hal.drafters import NgramDrafter
from hal.engine import Request, SpeculativeDecoder
from hal.engine.grammar import GrammarCompiler
from hal.engine.requests import StructuredOutputs
from hal.models.fetch import fetch
from hal.models.machine import machine_line
from hal.models.loaders import load_gguf
from hal.models.tokenizer import chatml

OUT = Path(__file__).parent / "results" / "structured.md"
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["city", "country", "population_millions", "continent", "capital", "languages", "rating"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
                         "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "South America",
                                                "Oceania"]},
                         "capital": {"type": "boolean"},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
                         "rating": {"enum": ["low", "medium", "high"]}}}
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Toronto", "Sydney", "Cairo", "Oslo", "Mumbai", "Quito"]


def prompt(city: str) -> str:
    return (f"Describe the city of {city} as JSON with exactly these fields: city, country, population_millions, "
            f"continent, capital, languages, rating. Schema: {json.dumps(SCHEMA)}")


def library_costs(tok, vocab: int, stop: tuple[int, ...], answer: list[int], reps: int = 5) -> list[str]:
    import llguidance
    rows = []
    llg_tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=list(stop))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})

    def llg_run():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
        t1 = time.perf_counter()
        for t in answer:
            m.compute_bitmask()
            m.consume_token(t)
            m.compute_bitmask()
            m.rollback(1)
            m.consume_token(t)
        assert not m.is_error(), m.get_error()
        return t1 - t0, (time.perf_counter() - t1) / len(answer)
    rows.append(("llguidance", [llg_run() for _ in range(reps)]))
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        rows.append(("xgrammar", None))
    else:
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=vocab,
                                                  stop_token_ids=list(stop))
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def xgr_run():
            t0 = time.perf_counter()
            m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                separators=(",", ":")),
                                   max_rollback_tokens=16)
            t1 = time.perf_counter()
            for t in answer:
                m.fill_next_token_bitmask(bitmask)
                assert m.accept_token(t)
                m.fill_next_token_bitmask(bitmask)
                m.rollback(1)
                m.accept_token(t)
            return t1 - t0, (time.perf_counter() - t1) / len(answer)
        rows.append(("xgrammar", [xgr_run() for _ in range(reps)]))
    lines = [f"A valid answer of {len(answer)} tokens, {reps} runs each, medians:", "",
             "| library | matcher creation (ms) | per token: mask, draft, mask, rollback, consume (ms) |", "|---|---|---|"]
    for name, runs in rows:
        if runs is None:
            lines.append(f"| {name} | not installed | |")
            continue
        lines.append(f"| {name} | {statistics.median(r[0] for r in runs) * 1e3:.1f} | "
                     f"{statistics.median(r[1] for r in runs) * 1e3:.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(2)
    be = hal.get_backend("cpu")
    target, tok = load_gguf(fetch("smollm2-135m"), be, "auto")
    stop = tuple(target.cfg.stop_ids)
    compiler = GrammarCompiler(tok.to_str(), target.cfg.vocab, stop)
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    costs = SpeculativeDecoder(target, NgramDrafter(be), num_blocks=256).profile_costs(max_tokens=17, context=300)

    def run(drafter, ids, k, routed=False):
        dec = SpeculativeDecoder(target, drafter, num_blocks=256, grammar=compiler)
        if routed:
            from hal.engine.router import Router
            dec.router = Router(costs, max_k=k)
        t = time.perf_counter()
        out = dec.generate([Request(ids, max_new_tokens=args.max_tokens, k=k, stop_ids=stop, structured=spec)])[0]
        return out, time.perf_counter() - t, dec.metrics.total
    systems = [("plain", lambda ids: run(None, ids, 0)),
               (f"n-gram k={args.k}", lambda ids: run(NgramDrafter(be), ids, args.k)),
               (f"n-gram routed k<={args.k}", lambda ids: run(NgramDrafter(be), ids, args.k, True))]
    times = {name: 0.0 for name, _ in systems}
    accepted = {name: [0, 0] for name, _ in systems}
    plain_out, answers, complete = {}, [], 0
    with torch.inference_mode():
        run(NgramDrafter(be), tok.encode(chatml(prompt("Rome"))).ids, args.k)   # warm-up
        for city in CITIES[:args.prompts]:
            ids = tok.encode(chatml(prompt(city))).ids
            for name, fn in systems:
                out, dt, tot = fn(ids)
                times[name] += dt
                accepted[name][0] += tot.num_accepted_tokens
                accepted[name][1] += len(out)
                if name == "plain":
                    plain_out[city] = out
                    text = tok.decode(out, skip_special_tokens=True)
                    json.loads(text)   # every answer is JSON (the grammar ended it)
                    complete += out[-1] in stop
                    answers.append(out)
                else:
                    assert out == plain_out[city], f"{name}: output differs from plain for {city}"
    lines = ["# Structured outputs (SmolLM2-135M-Instruct, cpu)", "",
             f"Command: `python benchmarks/structured.py --prompts {args.prompts} --max-tokens {args.max_tokens} "
             f"--k {args.k}`; {machine_line(target.plan, 2)}; {time.strftime('%Y-%m-%d')}.", "",
             "## Grammar library (the schema below, this tokenizer)", ""]
    longest = max(answers, key=len)
    lines += library_costs(tok, target.cfg.vocab, stop, [t for t in longest if t not in stop])   # rolling back a
    #                                                                     matcher past its stop token is refused
    lines += ["", "## Speculative decoding under a JSON schema", "",
              f"{args.prompts} chat prompts (the schema in the prompt), greedy, each request alone, interleaved "
              f"prompt by prompt; {complete} of {args.prompts} answers ended by the grammar within "
              f"{args.max_tokens} tokens, all valid JSON; every speculative output identical to plain.", "",
              "| system | total time (s) | vs plain | accepted drafts / emitted tokens |", "|---|---|---|---|"]
    for name, _ in systems:
        lines.append(f"| {name} | {times[name]:.2f} | {times['plain'] / times[name]:.2f}x | "
                     f"{accepted[name][0]} / {accepted[name][1]} |")
    lines += ["", f"Schema: `{json.dumps(SCHEMA)}`"]
    publish(lines, OUT)


if __name__ == "__main__":
    main()
