"""Draft and target in different processes or hosts.

    torchrun --nproc-per-node 2 -m hal.launch --draft self:8 --prompt "..."
    HAL_PLACEMENT="draft=cpu,target=cuda:0" torchrun --nproc-per-node 2 -m hal.launch ...

Rank 0 runs the target and the `SpeculativeDecoder`; rank 1 is the draft worker. The
link is gloo for cpu and cross-vendor pairs, the backends' own collective (nccl, hccl)
when both sides share it. One round: the target sends COMMIT (the tokens it committed
since the last round and each request's k), the worker answers DRAFTS built on exactly
that committed prefix, which the target checks (base length and hash) before verifying;
so the draft never builds on uncommitted tokens and a stale draft is dropped.

Overlap: right after answering, while the target verifies, the worker drafts the next
round for the likeliest outcomes of this one (each accept length x its top bonus-token
guesses, ``--fanout`` branches per request; `hal.distributed.speculate`). If the COMMIT
that arrives is one of them the reply comes from that speculation cache at once; else the
worker drafts afresh. If the worker dies or times out, the
target finishes every request by plain decoding (identical output; counted in
``metrics.draft_failures``). Without torchrun (WORLD_SIZE unset) the draft runs in-process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hal.distributed.remote import RemoteDrafter
from hal.engine import Request
from hal.errors import HalError
from hal.launch.config import LaunchConfig
from hal.launch.flags import add_engine_args, bounded
from hal.launch.start import start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hal.launch", description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--prompt", action="append", default=[], help="repeatable: one request each")
    ap.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable); "
                                                                      "for models without a tokenizer")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=bounded(float, 0, finite=True), default=0.0,
                    help="0: greedy (default); a finite float > 0: sampled")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write outputs and metrics as JSON here")
    ap.add_argument("--max-context", type=int, default=2048, help="prompt + generated tokens per request (planned)")
    args = ap.parse_args(argv)
    try:
        config = LaunchConfig.from_args(args, max_context=args.max_context,
                                        max_num_seqs=max(1, len(args.prompt) + len(args.prompt_ids)),
                                        max_num_batched_tokens=None)
        return _run(args, config)
    except HalError as e:
        print(f"hal.launch: {e}", file=sys.stderr)
        return 2


def _run(args, config: LaunchConfig) -> int:
    from hal.models.tokenizer import prompt_ids
    t0 = start(config)
    if t0 is None:   # the draft rank
        return 0
    dec, tok, world, backend, target_side = t0.dec, t0.tok, t0.world, t0.link, t0.side
    model, drafter, metrics = dec.target, dec.drafter, dec.metrics
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
    if args.prompt and tok is None:
        raise HalError(f"--prompt: model {args.model} has no tokenizer; pass --prompt-ids")
    prompts += [prompt_ids(tok, t0.template, p) for p in args.prompt]
    if not prompts:
        raise HalError("--prompt: expected at least one --prompt or --prompt-ids, got none")
    if (longest := max(map(len, prompts)) + args.max_tokens) > args.max_context:
        raise HalError(f"--max-context: expected at least the longest prompt + --max-tokens = {longest} tokens "
                       f"(the memory plan's context), got {args.max_context}")
    reqs = [Request(p, max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    seed=args.seed + i, k=args.k, stop_ids=model.cfg.stop_ids) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    try:
        outs = dec.generate(reqs)
    finally:
        t0.close()
    dt = time.perf_counter() - t
    for p, o in zip(args.prompt_ids + args.prompt, outs):
        print(f"=== {p[:60]!r}\n{o if tok is None else tok.decode(o, skip_special_tokens=True)}\n")
    m, remote = metrics, isinstance(drafter, RemoteDrafter)
    summary = {"outputs": outs, "seconds": dt, "tokens": sum(map(len, outs)), "world_size": world,
               "link": backend if world == 2 else None, "target": f"{target_side.backend.name}@{target_side.device}",
               "acceptance_rate": m.acceptance_rate, "mean_acceptance_length": m.mean_acceptance_length,
               "draft_failures": m.draft_failures, "stale_drafts": m.stale_drafts,
               "cache_hits": drafter.cache_hits if remote else 0, "cache_misses": drafter.cache_misses if remote else 0,
               "fanout_branches": m.fanout_branches, "draft_ahead_seconds": m.draft_ahead_seconds,
               "draft_inline_seconds": m.draft_inline_seconds, "pushed_rounds": m.pushed_rounds,
               "steps": dec.steps}
    if world == 2 and drafter is not None:   # what crossed the link, and the share of time spent in rounds
        summary.update(rounds=drafter.rounds, round_trip_seconds=drafter.wait_s, epoch=drafter.epoch,
                       workers_lost=m.workers_lost, workers_rejoined=m.workers_rejoined,
                       bytes_sent=drafter.bytes_sent, bytes_received=drafter.bytes_received)
    print(json.dumps({k: v for k, v in summary.items() if k != "outputs"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f)
    return 0

