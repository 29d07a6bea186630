"""Q4_K_M files against llama.cpp on the same file: plain decode and what a verify costs (issue 69;
not in ``make test``).

Files: the random-weight Q4_K_M files of ``benchmarks/family_shapes.py``'s shapes (made there,
or here if missing) and the bundled SmolLM2-135M re-quantized to Q4_K_M by ``llama-quantize``
(from its Q4_1 file, ``--allow-requantize``: the types are what a user's Q4_K_M has; the
values are a requantization's). On each, interleaved ``--rounds`` times, same threads:

* plain decode: spec-hal (``load_gguf``, the plan measured here; ``--tg`` tokens after a
  one-token prompt, k = 0, best of 3) against ``llama-bench`` tg (mean of 3);
* a verify's cost against a decode's: spec-hal's ``cost(5) / cost(1)`` and ``cost(9) / cost(1)``
  from the router's profile (a context of 128) against llama.cpp's own for the same batch,
  ``5 · tg / pp5`` and ``9 · tg / pp9`` (``llama-bench -p 5`` / ``-p 9``: tokens per second of
  a 5- or 9-token batch on an empty context, against its tg rate).

* the server's rate: a plain greedy request of ``--tg`` tokens (a 32-token prompt) through
  spec-hal's engine and through ``llama-server``, alternating request by request
  (`benchmarks.llamacpp.plain_rounds`, tokens/s each, medians).

spec-hal runs these files' rows as one int8 code per input (llama.cpp's int8 rows,
`hal.models.loaders.file_row_codes`); the same file loaded with two codes (value and residual,
``row_codes=2``) is measured beside it, interleaved.

    python benchmarks/kquant_costs.py [--shapes qwen2.5-0.5b,qwen3-0.6b,llama3.2-1b] [--rounds 2]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hal  # noqa: E402
from benchmarks.family_shapes import make_files, shape_args  # noqa: E402
from benchmarks.llamacpp import llama_bench, llama_tools, our_decode_rate, plain_rounds, server_binary  # noqa: E402
from benchmarks.report import publish  # noqa: E402
from hal.models.machine import cpu_flags, machine_line  # noqa: E402

OUT = Path(__file__).parent / "results" / "kquant_costs.md"


def llama_pp(binary: str, gguf: Path, threads: int, n: int, reps: int = 3) -> float:
    """llama-bench's rate (tokens/s, its mean over ``reps``) for an ``n``-token batch."""
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-p", str(n), "-n", "0", "-r", str(reps), "-o", "json"]
    if any(f.startswith("amx") for f in cpu_flags()):
        cmd += ["--repack", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    runs = [r for r in json.loads(out.stdout) if r.get("n_prompt") == n and not r.get("n_gen")]
    return float(runs[0]["avg_ts"])


def our_costs(model) -> tuple[float, float]:
    """spec-hal's ``cost(5) / cost(1)`` and ``cost(9) / cost(1)`` (the router's profile)."""
    from hal.engine.memory import target_pool
    from hal.engine.costs import interpolate, profile_costs
    costs = profile_costs(model, None, target_pool(model, 64), max_tokens=9, context=128, reps=5)
    one = interpolate(costs.verify, 1)
    return interpolate(costs.verify, 5) / one, interpolate(costs.verify, 9) / one


def bundled_q4_k_m(work: Path, quantize: str) -> Path:
    from hal.models.fetch import fetch
    out = work / "smollm2-135m-q4_k_m.gguf"
    if not out.exists():
        subprocess.run([quantize, "--allow-requantize", str(fetch("smollm2-135m")), str(out), "Q4_K_M"], check=True,
                       capture_output=True)
    return out


def main() -> None:
    ap = shape_args(__doc__)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bench, quantize = llama_tools()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from hal.models.loaders import load_gguf
    files = {"smollm2-135m": bundled_q4_k_m(work, quantize)}
    files.update({name: make_files(name, work, quantize)["Q4_K_M"] for name in args.shapes.split(",") if name})
    rows = []
    for name, path in files.items():
        model, _ = load_gguf(path, hal.get_backend("cpu"), "auto")
        two, _ = load_gguf(path, hal.get_backend("cpu"), plan=model.plan, row_codes=2)
        got = {k: [] for k in ("ours", "ours2", "theirs", "o5", "o9", "p5", "p9", "t5", "t9")}
        for _ in range(args.rounds):   # interleaved
            got["ours"].append(our_decode_rate(model, args.tg))
            got["ours2"].append(our_decode_rate(two, args.tg))
            tg = llama_bench(bench, path, args.threads, args.tg)
            got["theirs"].append(tg)
            for key, m in (("o", model), ("p", two)):
                c5, c9 = our_costs(m)
                got[key + "5"].append(c5)
                got[key + "9"].append(c9)
            got["t5"].append(5 * tg / llama_pp(bench, path, args.threads, 5))
            got["t9"].append(9 * tg / llama_pp(bench, path, args.threads, 9))
        served = plain_rounds(server_binary(), path, args.threads, model, list(range(100, 132)), args.tg,
                              args.rounds)
        got["served"], got["server"] = served if served else ([float("nan")], [float("nan")])
        m = {k: statistics.median(v) for k, v in got.items()}
        rows.append(f"| {name} | {m['ours']:.1f} | {m['ours2']:.1f} | {m['theirs']:.1f} | "
                    f"{m['ours'] / m['theirs']:.2f}x | {m['o5']:.2f} | {m['p5']:.2f} | {m['t5']:.2f} | "
                    f"{m['o9']:.2f} | {m['p9']:.2f} | {m['t9']:.2f} | "
                    f"{m['served']:.1f} | {m['server']:.1f} | {m['served'] / m['server']:.2f}x | "
                    f"{'native' if model.loop is not None else 'Python'} |")
        print(rows[-1], model.tensor_forms, model.plan.describe(), sep="\n", flush=True)
        del model, two
    lines = ["# Q4_K_M files against llama.cpp: plain decode and a verify's cost", "",
             f"`python benchmarks/kquant_costs.py --shapes {args.shapes} --threads {args.threads} --tg {args.tg} "
             f"--rounds {args.rounds}`", "", machine_line(), "",
             "Decode: tokens/s of a plain decode (spec-hal best of 3, llama-bench tg mean of 3). cost(n)/cost(1): a "
             "forward over n tokens against one token's (spec-hal: the router's profile at a context of 128; "
             "llama.cpp: n · tg / pp_n from llama-bench on an empty context). Medians over the rounds. spec-hal "
             "runs these files' rows as one int8 code per input (its default for a file with K-quants); "
             "\"two codes\": the same file with rows of value and residual codes (`row_codes=2`), interleaved. "
             "Served: a plain greedy request of the same tokens through spec-hal's engine and llama-server, "
             "alternating request by request (a 32-token prompt; tokens/s of each, medians).", "",
             "| file (Q4_K_M) | spec-hal tok/s | two codes | llama.cpp tok/s | ratio | spec-hal cost(5)/cost(1) | "
             "two codes | llama.cpp's | spec-hal cost(9)/cost(1) | two codes | llama.cpp's | spec-hal request "
             "tok/s | llama-server tok/s | ratio | spec-hal's layers |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]
    publish(lines, Path(args.out))


if __name__ == "__main__":
    main()
