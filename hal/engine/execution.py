"""One step's execution on the device, given the scheduler's `StepPlan` and the drafts:
one ragged target forward (the decoding requests' ``[last token, drafts...]``, all rows
verified, then the prefill chunks' last rows), verification, the accepted tree path's KV
compaction, logprobs, first tokens for completed prefills, the lookahead drafter's next
proposal, and the step's one readback. Changes no request state: the engine applies the
`StepResult`."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from hal import kv
from hal.devices import transfer
from hal.engine import grammar, proposals, trees
from hal.engine.forward import forward_tokens, logprob_rows, sampling_args, sampling_tensors, target_probs
from hal.engine.history import HistoryBuffer
from hal.engine.processors import processor_args
from hal.engine.drafting import Drafter, DrafterCapabilities
from hal.engine.step_types import Logprobs, StepDrafts, StepPlan, StepReads, StepResult, read_back
from hal.models.llama import Llama
from hal.ops import cumulative


@dataclass
class Offsets:
    """Philox offsets the engine spent for this step's draws, one per request."""

    verify: list[int] | None   # [R] for sampled verification; None: an all-greedy batch
    first: list[int]           # [F] for the first token of each request whose prefill completes


def execute(target: Llama, pool: kv.KVPool, history: HistoryBuffer, drafter: Drafter | None, plan: StepPlan,
            drafts: StepDrafts, offsets: Offsets, caps: DrafterCapabilities) -> StepResult:
    """Run ``plan`` with ``drafts``; everything stays on the device until one readback.
    ``caps``: the drafter's `capabilities` (the engine reads them once)."""
    backend, dev = target.be, target.device
    live, counts, chunks = plan.decode, drafts.counts, plan.prefill
    first, resumed = plan.first, plan.resumed
    fed = len(live) + sum(counts)
    tokens, lens = _fed_tokens(plan, drafts, dev)
    ends = torch.tensor(lens).cumsum(0)
    rows = torch.cat([torch.arange(fed), ends[len(live):] - 1])
    layers = caps.features   # a feature drafter reads every fed row's feature
    depth, mask = (None, None) if drafts.parent_ids is None else trees.layout(
        drafts.parent_ids, counts, [c.num_tokens for c in chunks], dev)
    logits, hidden = forward_tokens(target, pool, [state.seq for state in live] + [c.state.seq for c in chunks], lens,
                                    tokens, rows=rows, feature_layers=layers or (),
                                    hidden_rows=None if layers is None else torch.arange(sum(lens)),
                                    tree_mask=mask, depth=depth)
    want = [state.req.logprobs or 0 for state in live + first if state.req.logprobs is not None]
    top_n = max(want, default=0)
    reads = StepReads()
    if live:
        _verify(backend, pool, history, plan, drafts, logits[:fed], offsets.verify, bool(want), top_n, reads)
    if first:
        where = {c.state.rid: i for i, c in enumerate(chunks)}
        frows = logits[fed:][torch.tensor([where[state.rid] for state in first]).to(dev)]
        none = torch.zeros(0, dtype=torch.long, device=dev)
        allowed = grammar.masks(first, [0] * len(first), None, None, frows.shape[1], dev)
        frows_p, reads.first_dead = processed(backend, first, frows, none, [0] * len(first), None, allowed)
        tok, _ = backend.sample(frows_p,
                                *sampling_args(first, [1] * len(first), dev, offsets.first))
        reads.first = tok.long()
        if want:
            reads.first_logprobs = Logprobs(*_padded(logprob_rows(frows, tok, top_n)))
        history.write([state.rid for state in first], [len(state.tokens) for state in first], reads.first[:, None])
    t = time.perf_counter()
    ahead = None if not caps.lookahead else proposals.lookahead(
        drafter, history, live, first, resumed, reads.accepted, dev, plan.k, plan.ahead)
    ahead_s = time.perf_counter() - t
    if ahead is not None and ahead.proposal.num_valid is not None:
        reads.lookahead_valid = ahead.proposal.num_valid
    return StepResult(read_back(reads), hidden, fed, top_n, layers is not None, drafts, ahead,   # the one host sync
                      ahead_s)


def _fed_tokens(plan: StepPlan, drafts: StepDrafts, dev) -> tuple[Tensor, list[int]]:
    """The flat fed tokens (each decoding request's last token then its drafts, then the
    prefill chunks) on ``dev``, and the tokens fed per request."""
    counts = drafts.counts
    lens = [1 + c for c in counts] + [c.num_tokens for c in plan.prefill]
    host, draft_slots = [], []
    for s, c in zip(plan.decode, counts):
        draft_slots += range(len(host) + 1, len(host) + 1 + c)
        host += [s.tokens[-1]] + [0] * c
    for chunk in plan.prefill:
        s = chunk.state
        host += s.tokens[s.prefilled:s.prefilled + chunk.num_tokens]
    tokens = torch.tensor(host, dtype=torch.long).to(dev)
    if draft_slots:
        tokens[torch.tensor(draft_slots).to(dev)] = drafts.token_ids
    return tokens, lens


def _verify(backend, pool: kv.KVPool, history: HistoryBuffer, plan: StepPlan, drafts: StepDrafts, logits: Tensor,
            verify_offsets: list[int] | None, logprobs: bool, top_n: int, reads: StepReads) -> None:
    """Verify the decoding rows into ``reads``; a tree's accepted path moves next to its root."""
    live, counts, dev = plan.decode, drafts.counts, logits.device
    allowed = grammar.masks(live, counts, drafts.token_ids, drafts.parent_ids, logits.shape[1], dev, drafts.host_ids)
    target, reads.dead = processed(backend, live, logits, drafts.token_ids, counts, drafts.parent_ids, allowed)
    verified = trees.verify(backend, live, counts, drafts.token_ids, drafts.probs, target, drafts.parent_ids,
                            verify_offsets)
    reads.out, reads.accepted, reads.nodes = verified.out, verified.accepted, verified.nodes
    if verified.nodes is not None:
        trees.compact(backend, pool, [s.seq for s in live], counts, verified.nodes)
    if logprobs:
        width = verified.out.shape[1]
        flat = torch.tensor([i * width + j for i, c in enumerate(counts) for j in range(c + 1)]).to(dev)
        rows = logits if verified.nodes is None else logits[
            trees.path_rows(verified.nodes, counts, dev).reshape(-1)[flat]]
        reads.logprobs = Logprobs(*_padded(logprob_rows(rows, verified.out.reshape(-1)[flat], top_n)))
    if drafts.shadow:
        reads.shadow_scores = _shadow_scores(live, drafts, target, verified.out)
    history.write([s.rid for s in live], [len(s.tokens) for s in live], verified.out)


def _shadow_scores(live, drafts: StepDrafts, target: Tensor, out: Tensor) -> Tensor:
    """[G] fp32: each scored first draft (`StepDrafts.shadow`, its request at k = 0) scored
    against its request's target row (processed, as verified): 1 or 0 where greedy (is it the
    emitted token?), and where sampled p(draft) under the row's sampling distribution, the
    chance a verify would have accepted that deterministic draft (its expectation: no draw)."""
    dev = target.device
    at = [i for i, _ in drafts.shadow]
    slots = torch.tensor([j for _, j in drafts.shadow]).to(drafts.proposal.draft_token_ids.device)
    guess = transfer(drafts.proposal.draft_token_ids[slots], dev).long()
    scores = (guess == out[at, 0]).float()
    sampled = [g for g, i in enumerate(at) if live[i].req.temperature > 0]
    if sampled:
        first = cumulative([1 + c for c in drafts.counts])      # each request's first verified row
        reqs = [live[at[g]].req for g in sampled]
        rows = target[torch.tensor([first[at[g]] for g in sampled]).to(dev)]
        p = target_probs(rows, *sampling_tensors(reqs, [1] * len(reqs), dev), params=reqs)
        pick = torch.tensor(sampled).to(dev)
        scores[pick] = p.gather(1, guess[pick][:, None])[:, 0].float()
    return scores


def processed(backend, states, logits: Tensor, ids: Tensor, counts: list[int], parents: Tensor | None,
              allowed: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``logits`` (``[N + R, V]``, target rows) through the requests' logits processors (the
    drafts on each row's path count as generated), then their grammars' masks (``allowed``,
    `hal.engine.grammar.masks`), and which rows that left without any token (``[N + R]``
    bool; None when nothing is on). Such a row reads 0 everywhere, so that sampling and
    verification run; the engine fails its request alone (`StepOutput.errors`). Logprobs
    stay raw (vLLM's default ``raw_logprobs``): they read the unprocessed rows."""
    args = processor_args(states, logits.shape[1], logits.device)
    if args is None and allowed is None:
        return logits, None
    if args is not None:
        cu = torch.tensor([0, *counts]).cumsum(0).to(logits.device)
        logits = backend.process_logits(logits, ids, cu, parents, **args, max_k=max(counts, default=0))
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(logits).all(-1)
    return logits.masked_fill(dead[:, None], 0.0), dead


def _padded(rows: list[Tensor]) -> list[Tensor | None]:
    """`logprob_rows`' ``[logprob]`` or ``[logprob, top values, top ids]`` as three fields."""
    return rows + [None] * (3 - len(rows))

