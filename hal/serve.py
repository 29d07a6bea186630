"""Draft and target in different processes or hosts.

    torchrun --nproc-per-node 2 -m hal.serve --draft self:8 --prompt "..."
    HAL_PLACEMENT="draft=cpu,target=cuda:0" torchrun --nproc-per-node 2 -m hal.serve ...

Rank 0 runs the target and the `SpeculativeDecoder`; rank 1 is the draft worker. The
link is gloo for cpu and cross-vendor pairs, the backends' own collective (nccl, hccl)
when both sides share it. One round: the target sends COMMIT (the tokens it committed
since the last round and each request's k), the worker answers DRAFTS built on exactly
that committed prefix, which the target checks (base length and hash) before verifying;
so the draft never builds on uncommitted tokens and a stale draft is dropped.

Overlap: right after answering, while the target verifies, the worker drafts the next
round assuming everything is accepted and guessing the bonus token (its own next
draft). If the COMMIT that arrives matches that guess the reply is immediate; else the
guess is dropped and the worker drafts afresh. If the worker dies or times out, the
target finishes every request by plain decoding (identical output; counted in
``metrics.draft_failures``). Without torchrun (WORLD_SIZE unset) the draft runs in-process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import Tensor

from hal.checks import MAX_K, prob_values
from hal.decoder import Request, SpeculativeDecoder, State
from hal.errors import HalError
from hal.placement import Placement, dense_q, link_backend, sparse_q, transfer

COMMIT, DRAFTS, STOP = 1, 2, 3
MAX_WORDS, MAX_ROWS, MAX_COLS = 1 << 24, 1 << 20, 1 << 20  # what a peer's message header may announce
TARGET, DRAFT = 0, 1
DRAFT_SEED = 1 << 40  # the worker's draws use (seed + DRAFT_SEED, offset): a stream the target never uses


HASH_SEED = 1469598103934665603


def history_hash(tokens: list[int], h: int = HASH_SEED) -> int:
    """A chained hash of a token history; ``history_hash(b, history_hash(a)) == history_hash(a + b)``,
    so each side extends it with the tokens committed since the last round only."""
    for t in tokens:
        h = ((h ^ (t + 1)) * 1099511628211) & ((1 << 62) - 1)
    return h


class Link:
    """Messages between the two ranks: int64 words, optional float32 rows, optional int32
    indices (sparse q). Sends are non-blocking; a receive may time out."""

    def __init__(self, peer: int, device: torch.device):
        self.peer, self.device, self._sending, self._keep = peer, device, [], []

    def flush(self) -> None:
        """Wait until the last message has left."""
        for w in self._sending:
            w.wait()

    def send(self, words: list[int], rows: Tensor | None = None, idx: Tensor | None = None) -> None:
        self.flush()
        parts = [torch.tensor(words, dtype=torch.long)]
        parts += [rows.float().contiguous()] if rows is not None else []
        parts += [idx.to(torch.int32).contiguous()] if idx is not None else []
        r = rows.shape if rows is not None else (0, 0)
        head = torch.tensor([len(words), r[0], r[1], idx is not None], dtype=torch.long)
        parts = [transfer(t, self.device) for t in [head] + parts]
        self._sending = [dist.isend(t, self.peer) for t in parts]
        self._keep = parts

    def recv(self, timeout: float | None) -> tuple[list[int], Tensor | None, Tensor | None]:
        """One message. The header comes from another process: sizes it announces are checked
        before anything is allocated (`HalError` when out of bounds)."""
        head = self._recv(torch.empty(4, dtype=torch.long), timeout).tolist()
        if not (1 <= head[0] <= MAX_WORDS and 0 <= head[1] <= MAX_ROWS and 0 <= head[2] <= MAX_COLS
                and head[1] * head[2] <= MAX_ROWS * 64 and head[3] in (0, 1)):
            raise HalError(f"hal.serve: expected a message header within bounds, got {head}")
        words = self._recv(torch.empty(head[0], dtype=torch.long), timeout).tolist()
        rows = self._recv(torch.empty(head[1], head[2]), timeout) if head[1] else None
        idx = self._recv(torch.empty(head[1], head[2], dtype=torch.int32), timeout) if head[1] and head[3] else None
        return words, rows, idx

    def _recv(self, t: Tensor, timeout: float | None) -> Tensor:
        t = t.to(self.device)
        work = dist.irecv(t, self.peer)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        return t


class RemoteDrafter:
    """The target's view of the draft worker (a `hal.decoder.Drafter`)."""

    def __init__(self, link: Link, vocab: int, device: torch.device, metrics, timeout: float = 30.0,
                 first_timeout: float = 60.0):
        self.link, self.vocab, self.device, self.metrics = link, vocab, device, metrics
        self.timeout, self.first_timeout = timeout, first_timeout
        self.sent: dict[int, int] = {}     # rid -> tokens of its history the worker has
        self.hashes: dict[int, int] = {}   # rid -> history_hash of those tokens
        self.finished: list[int] = []
        self.alive, self.lost, self.rounds, self.guess_hits, self.guess_misses = True, False, 0, 0, 0

    def propose(self, states: list[State]) -> tuple[list[list[int]], Tensor | None]:
        empty = [[] for _ in states], None
        if not self.alive:
            return empty
        live = {s.rid for s in states}
        self.finished += [rid for rid in self.sent if rid not in live]
        for rid in self.finished:
            self.sent.pop(rid, None)
            self.hashes.pop(rid, None)
        words, floats = [COMMIT, len(states), len(self.finished), *self.finished], []
        self.finished = []
        for s in states:
            new = s.rid not in self.sent
            words += [s.rid, s.req_k, len(s.tokens), int(new)]
            if new:
                words += [s.req.top_k, s.req.seed, s.req.max_new_tokens]
                floats.append([s.req.temperature, s.req.top_p])
            delta = s.tokens[self.sent.get(s.rid, 0):]
            words += [len(delta), *delta]
            self.sent[s.rid] = len(s.tokens)
            self.hashes[s.rid] = history_hash(delta, self.hashes.get(s.rid, HASH_SEED))
        try:
            self.link.send(words, torch.tensor(floats) if floats else None)
            reply, rows, idx = self.link.recv(self.timeout if self.rounds else self.first_timeout)
        except RuntimeError as e:  # gloo: connection reset (the worker died) or a timeout
            self.lost = True
            self._fail(e)
            return empty
        except HalError as e:      # a header out of bounds
            self._fail(e)
            return empty
        self.rounds += 1
        try:
            return self._accept(states, reply, rows, idx)
        except HalError as e:      # the reply is not a valid DRAFTS message: plain decoding from here
            self._fail(e)
            return empty

    def _accept(self, states: list[State], reply: list[int], rows, idx) -> tuple[list[list[int]], Tensor | None]:
        """The drafts of a DRAFTS reply. It comes from another process, maybe another host:
        every field is checked (kind, counts, lengths, token ids in [0, V), q rows) and a
        malformed reply raises `HalError`; drafts not built on the committed prefix are dropped."""
        def bad(what: str):
            raise HalError(f"draft worker reply: expected {what}")
        if len(reply) < 3 or reply[0] != DRAFTS:
            bad(f"a DRAFTS message, got kind {reply[0] if reply else None} of {len(reply)} words")
        if not (0 <= reply[1] <= len(states) and 0 <= reply[2] <= len(states)):
            bad(f"overlap counts in [0, {len(states)}], got {reply[1:3]}")
        parsed, at = [], 3
        for s in states:
            if at + 4 > len(reply):
                bad(f"an entry for request {s.rid}, got a reply truncated at word {len(reply)}")
            rid, base_len, base_hash, n = reply[at:at + 4]
            if not 0 <= n <= MAX_K or at + 4 + n > len(reply):
                bad(f"0 <= drafts <= {MAX_K} within the reply for request {s.rid}, got {n}")
            d = reply[at + 4:at + 4 + n]
            if any(not 0 <= t < self.vocab for t in d):
                bad(f"draft token ids in [0, {self.vocab}) for request {s.rid}, got {[t for t in d if not 0 <= t < self.vocab][:4]}")
            parsed.append((rid, base_len, base_hash, d))
            at += 4 + n
        if at != len(reply):
            bad(f"{at} words, got {len(reply)}")
        total = sum(len(p[3]) for p in parsed)
        if rows is not None and (rows.dim() != 2 or rows.shape[0] != total or (idx is None and rows.shape[1] != self.vocab)):
            bad(f"{total} q rows of width {self.vocab}, got shape {list(rows.shape)}")
        if idx is not None and (rows is None or idx.shape != rows.shape or bool(((idx < 0) | (idx >= self.vocab)).any())):
            bad(f"sparse q indices in [0, {self.vocab}) shaped like its values")
        self.guess_hits += reply[1]
        self.guess_misses += reply[2]
        self.metrics.stale_drafts += reply[2]
        drafts, keep, r = [], [], 0
        for s, (rid, base_len, base_hash, d) in zip(states, parsed):
            n = len(d)
            ok = rid == s.rid and base_len == len(s.tokens) and base_hash == self.hashes[s.rid] and n <= max(
                s.req_k, 0)
            if not ok:  # not built on the committed prefix: dropped
                self.metrics.stale_drafts += 1
                d = []
            keep += range(r, r + len(d))
            r += n
            drafts.append(d)
        if rows is None or not keep:
            return drafts, None
        rows = transfer(rows[keep], self.device)
        q = rows if idx is None else dense_q(transfer(idx[keep], self.device), rows, self.vocab)
        prob_values("draft_probs (from the draft worker)", q)
        return drafts, q

    def _fail(self, e: Exception) -> None:
        self.alive = False
        self.metrics.draft_failures += 1
        print(f"hal.serve: draft worker lost ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
              "finishing every request by plain decoding", file=sys.stderr, flush=True)

    def accepted(self, states, drafted, n_accepted) -> None:
        pass

    def release(self, state: State) -> None:
        self.hashes.pop(state.rid, None)
        if self.sent.pop(state.rid, None) is not None:
            self.finished.append(state.rid)

    def close(self) -> None:
        if not self.lost:  # a worker we stopped listening to (bad reply) still gets its STOP
            try:
                self.link.send([STOP])
                self.link.flush()
            except RuntimeError:
                pass


Guess = dict[int, tuple[list[int], list[int], Tensor | None]]  # rid -> (assumed history, drafts, q rows)


def draft_worker(link: Link, drafter, fault: str = "", idle: float | None = None) -> None:
    """Serve DRAFTS for each COMMIT until STOP (see the module docstring); ``idle``: the
    longest wait for the next COMMIT, in seconds (None: the link's default)."""
    states: dict[int, State] = {}
    hashes: dict[int, int] = {}  # rid -> history_hash of its committed history
    guess: Guess = {}
    replies = 0
    while True:
        words, floats, _ = link.recv(idle)
        if words[0] == STOP:
            return
        order = _apply_commit(words, floats, states, hashes, guess, drafter)
        out, hits, stale = _drafts_for(order, guess, drafter)
        if fault and replies == int(fault.split(":")[1]):  # fault injection for tests: HAL_SERVE_FAULT=
            if fault.startswith("kill"):                   # kill:N (SIGKILL after N replies),
                os.kill(os.getpid(), signal.SIGKILL)       # hang:N:S (stop answering for S s, then exit),
            if fault.startswith("hang"):                   # bad:N:KIND (reply N+1 malformed: KIND is
                time.sleep(float(fault.split(":")[2]))     # kind, truncated, oov, negative or count)
                os._exit(0)
        _reply(link, order, hashes, out, hits, stale,
               fault.split(":")[2] if fault.startswith("bad") and replies == int(fault.split(":")[1]) else "")
        replies += 1
        guess = _guess_next(order, out, drafter)  # overlaps the target's verification


def _apply_commit(words: list[int], floats, states: dict[int, State], hashes: dict[int, int], guess: Guess,
                  drafter) -> list[State]:
    """Extend each request's committed history (new requests arrive with their sampling
    parameters; finished ones are released). Returns the requests of this round, in order."""
    n, n_done = words[1], words[2]
    for rid in words[3:3 + n_done]:
        if (st := states.pop(rid, None)) is not None:
            drafter.release(st)
        guess.pop(rid, None)
        hashes.pop(rid, None)
    at, f, order = 3 + n_done, 0, []
    for _ in range(n):
        rid, k, length, new = words[at:at + 4]
        at += 4
        if new:
            top_k, seed, max_new = words[at:at + 3]
            at += 3
            temp, top_p = floats[f].tolist()
            f += 1
            req = Request([0], max_new_tokens=max_new, temperature=temp, top_k=top_k, top_p=top_p,
                          seed=seed + DRAFT_SEED, k=k)
            states[rid] = State(req, rid, [], seq=None)
        st, nd = states[rid], words[at]
        st.tokens = st.tokens + words[at + 1:at + 1 + nd]
        hashes[rid] = history_hash(words[at + 1:at + 1 + nd], hashes.get(rid, HASH_SEED))
        at += 1 + nd
        if len(st.tokens) != length:
            raise HalError(f"hal.serve: expected a committed history of {length} tokens for request {rid}, "
                           f"got {len(st.tokens)} (protocol out of step)")
        st.req_k = k
        order.append(st)
    return order


def _drafts_for(order: list[State], guess: Guess, drafter):
    """Each request's drafts (and q rows): the overlap guess where it holds (the target
    accepted everything and its bonus token was the draft's guess), else fresh ones."""
    hit_ids = {s.rid for s in order if s.req_k and s.rid in guess and guess[s.rid][0] == s.tokens
               and len(guess[s.rid][1]) >= s.req_k}
    stale = sum(1 for s in order if s.rid in guess and s.rid not in hit_ids)
    out: dict[int, tuple[list[int], Tensor | None]] = {s.rid: ([], None) for s in order}
    for s in order:
        if s.rid in hit_ids:
            _, d, q = guess[s.rid]
            out[s.rid] = (d[:s.req_k], None if q is None else q[:s.req_k])
    fresh = [s for s in order if s.req_k and s.rid not in hit_ids]
    if fresh:
        d, q = drafter.propose(fresh)
        r = 0
        for s, ds in zip(fresh, d):
            out[s.rid] = (ds, None if q is None else q[r:r + len(ds)])
            r += len(ds)
    return out, len(hit_ids), stale


def _reply(link: Link, order: list[State], hashes: dict[int, int], out, hits: int, stale: int,
           corrupt: str = "") -> None:
    """DRAFTS: per request its base (length, hash) and drafts; q rows sparse when sampled
    with top-k/top-p. ``corrupt`` plants a malformed reply (fault injection for tests)."""
    words, rows = [DRAFTS, hits, stale], []
    for s in order:
        ds, q = out[s.rid]
        words += [s.rid, len(s.tokens), hashes[s.rid], len(ds), *ds]
        if q is not None:
            rows.append(q)
    q = torch.cat(rows) if rows else None
    sparse = q is not None and any(s.req.top_k > 0 or s.req.top_p < 1 for s in order)
    idx, q = sparse_q(q) if sparse else (None, q)
    link.send(corrupted(words, corrupt) if corrupt else words, q, idx)


def corrupted(words: list[int], how: str) -> list[int]:
    """A DRAFTS reply made invalid in one way (tests: the target must not trust it)."""
    w = list(words)
    first = 3 + 4  # the first request's first draft, when it has one
    if how == "kind":
        w[0] = 77
    elif how == "truncated":
        w = w[:max(4, len(w) // 2)]
    elif how == "count":
        w[3 + 3] = 1 << 40
    elif how in ("oov", "negative"):
        w = w[:3 + 3] + [w[3 + 3] + 1] + [1 << 20 if how == "oov" else -3] + w[first:]
    return w


def _guess_next(order: list[State], out, drafter) -> Guess:
    """Draft the next round assuming every draft is accepted: the chain continues with one
    more token (the guessed bonus) and then the next round's drafts."""
    spec = [s for s in order if s.req_k]
    guess: Guess = {}
    if not spec:
        return guess
    base = {s.rid: s.tokens for s in spec}
    for s in spec:
        s.tokens, s.req_k = s.tokens + out[s.rid][0], s.req_k + 1
    d, q = drafter.propose(spec)
    r = 0
    for s, ds in zip(spec, d):
        if ds:
            guess[s.rid] = (s.tokens + ds[:1], ds[1:], None if q is None else q[r + 1:r + len(ds)])
        r += len(ds)
        s.tokens, s.req_k = base[s.rid], s.req_k - 1
    return guess


def draft_memory(kind: str, model_path: str, shares_target: bool):
    """(ModelMemory of the draft model or None for n-gram, its weights' path)."""
    from hal.models.llama import read_config
    from hal.planner import ModelMemory
    if kind == "ngram":
        return None, None
    if kind.startswith("self"):
        cfg = read_config(model_path)
        layers = int(kind.split(":")[1]) if ":" in kind else cfg.layers // 2
        return ModelMemory.from_config(cfg, "draft", layers, owns_weights=not shares_target), model_path
    if kind.startswith("model:"):
        path = kind[len("model:"):]
        return ModelMemory.from_config(read_config(path), "draft"), path
    raise HalError(f"--draft: expected ngram, self[:L] or model:<path.gguf>, got {kind!r}")


def build_drafter(kind: str, side, path: str | None, pool, target=None):
    """The drafter: ``ngram``, ``self:L`` (first L layers; the target's weights when
    ``target`` is given) or ``model:<gguf>``, its KV in ``pool`` (from the memory plan)."""
    from hal.cli import load_model
    from hal.drafters import ModelDrafter, NgramDrafter
    if kind == "ngram":
        return NgramDrafter(side.backend)
    model = target if target is not None and kind.startswith("self") else load_model(path, side.backend)[0].to(
        side.device)
    layers = int(kind.split(":")[1]) if kind.startswith("self:") else (
        model.cfg.layers // 2 if kind == "self" else model.cfg.layers)
    return ModelDrafter(model.layer_view(layers), pool=pool)


def plan(args, target_mem, target_side, draft_mem, draft_side):
    """This rank's memory plan (printed); raises `HalError` before anything is allocated."""
    from hal.planner import GiB, plan_memory
    p = plan_memory(target_mem, target_side, draft_mem, draft_side,
                    max_seqs=max(1, len(args.prompt) + len(args.prompt_ids)), max_context=args.max_context,
                    max_k=args.k, budget_fraction=args.memory_fraction,
                    budget_bytes={"cpu": int(args.cpu_budget_gib * GiB)})
    print(p.report(), file=sys.stderr, flush=True)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hal.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="ngram", help="ngram, self[:L] or model:<path.gguf>")
    ap.add_argument("--model", default="smollm2-135m", help="a fetchable name, a .gguf path or an HF folder")
    ap.add_argument("--prompt", action="append", default=[], help="repeatable: one request each")
    ap.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable); "
                                                                      "for models without a tokenizer")
    ap.add_argument("--k", type=int, default=8, help="k per step, or its cap with --route")
    ap.add_argument("--route", action="store_true", help="adaptive k (profiles costs at start-up)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-startup-timeout", type=float, default=60.0,
                    help="seconds the target waits for the draft worker to join and send its first drafts; "
                         "then it serves alone by plain decoding")
    ap.add_argument("--draft-timeout", type=float, default=30.0, help="seconds to wait for drafts before "
                                                                       "falling back to plain decoding")
    ap.add_argument("--out", help="write outputs and metrics as JSON here")
    ap.add_argument("--max-context", type=int, default=2048, help="prompt + generated tokens per request (planned)")
    ap.add_argument("--memory-fraction", type=float, default=0.9, help="share of an accelerator's memory to plan in")
    ap.add_argument("--cpu-budget-gib", type=float, default=4.0, help="memory budget of a cpu side, GiB")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except HalError as e:
        print(f"hal.serve: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from hal.cli import load_model
    from hal.metrics import SpecDecodeMetrics
    from hal.models.tokenizer import chatml
    placement = Placement.from_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world not in (1, 2):
        raise HalError(f"WORLD_SIZE: expected 1 (in-process draft) or 2 (draft and target ranks), got {world}")
    rank = int(os.environ.get("RANK", "0"))
    joined = False
    if world == 2:
        backend = link_backend(placement)
        try:  # bounded: a worker that dies before the rendezvous must not hold the target
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.draft_startup_timeout))
            joined = True
        except (RuntimeError, ValueError) as e:  # DistStoreError and friends: no peer within the timeout
            if rank == DRAFT:
                raise HalError(f"hal.serve: the target did not join within {args.draft_startup_timeout} s "
                               f"({type(e).__name__})") from e
            print(f"hal.serve: the draft worker did not join within {args.draft_startup_timeout} s "
                  f"({type(e).__name__}); serving alone by plain decoding", file=sys.stderr, flush=True)
    from hal.models.fetch import MODELS, fetch
    from hal.models.llama import read_config
    from hal.placement import resolve_side
    from hal.planner import ModelMemory
    path = str(fetch(args.model) if args.model in MODELS and not (rank == DRAFT and args.draft == "ngram")
               else args.model)  # an n-gram worker needs no weights
    if rank == DRAFT:  # plan, allocate, load, serve
        draft_side = resolve_side(placement.draft, "draft")
        mem, dpath = draft_memory(args.draft, path, shares_target=False)
        pool = plan(args, None, None, mem, draft_side).allocate("draft") if mem is not None else None
        link = Link(TARGET, torch.device("cpu") if backend == "gloo" else draft_side.device)
        drafter = build_drafter(args.draft, draft_side, dpath, pool)
        draft_worker(link, drafter, os.environ.get("HAL_SERVE_FAULT", ""), idle=max(600.0, args.draft_timeout))
        dist.destroy_process_group()
        return 0
    target_side = resolve_side(placement.target, "target")
    draft_side = resolve_side(placement.draft, "draft") if world == 1 else None
    shares = world == 1 and draft_side.device == target_side.device
    dmem, dpath = draft_memory(args.draft, path, shares) if world == 1 else (None, None)
    mplan = plan(args, ModelMemory.from_config(read_config(path), "target"), target_side, dmem, draft_side)
    pool = mplan.allocate("target")  # nothing was allocated before the plan passed
    model, tok = load_model(path, target_side.backend)
    model.to(target_side.device)
    metrics = SpecDecodeMetrics()
    if world == 2 and not joined:
        drafter = None
        metrics.draft_failures += 1
    elif world == 2:
        link = Link(DRAFT, torch.device("cpu") if backend == "gloo" else target_side.device)
        drafter = RemoteDrafter(link, model.cfg.vocab, target_side.device, metrics, args.draft_timeout,
                                first_timeout=args.draft_startup_timeout)
    else:
        drafter = build_drafter(args.draft, draft_side, dpath, mplan.allocate("draft") if dmem else None,
                                target=model if shares else None)
    dec = SpeculativeDecoder(model, drafter, metrics=metrics, pool=pool)
    if args.route:
        from hal.router import Router
        dec.router = Router(dec.profile_costs(profile_draft=world == 1), max_k=args.k)
    prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
    if args.prompt and tok is None:
        raise HalError(f"--prompt: model {args.model} has no tokenizer; pass --prompt-ids")
    prompts += [tok.encode(chatml(p)).ids for p in args.prompt]
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
        if world == 2 and joined:
            drafter.close()
            if not drafter.lost:
                dist.destroy_process_group()
    dt = time.perf_counter() - t
    for p, o in zip(args.prompt_ids + args.prompt, outs):
        print(f"=== {p[:60]!r}\n{o if tok is None else tok.decode(o, skip_special_tokens=True)}\n")
    m = metrics
    summary = {"outputs": outs, "seconds": dt, "tokens": sum(map(len, outs)), "world_size": world,
               "link": backend if world == 2 else None, "target": f"{target_side.backend.name}@{target_side.device}",
               "acceptance_rate": m.acceptance_rate, "mean_acceptance_length": m.mean_acceptance_length,
               "draft_failures": m.draft_failures, "stale_drafts": m.stale_drafts,
               "overlap_hits": getattr(drafter, "guess_hits", 0), "overlap_misses": getattr(drafter, "guess_misses", 0)}
    print(json.dumps({k: v for k, v in summary.items() if k != "outputs"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
