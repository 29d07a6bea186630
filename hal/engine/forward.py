"""The pieces the engine and the model drafters share: one ragged forward over a KV pool,
per-row sampling parameters, the target's p, logprobs, and the one host readback."""

from __future__ import annotations

import torch
from torch import Tensor

from hal import kv
from hal.models.llama import Batch, Llama
from hal.devices import transfer
from hal.engine.requests import TokenLogprob


def forward(model: Llama, pool: kv.KVPool, seqs: list[kv.Sequence], chunks: list[list[int]], all_rows: bool,
            tree_mask: Tensor | None = None, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`forward_tokens` with the fed tokens given as host lists."""
    tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.long).to(model.device)
    return forward_tokens(model, pool, seqs, [len(c) for c in chunks], tokens, all_rows, tree_mask, rows)


def forward_tokens(model: Llama, pool: kv.KVPool, seqs: list[kv.Sequence], lens: list[int], tokens: Tensor,
                   all_rows: bool = False, tree_mask: Tensor | None = None,
                   rows: Tensor | None = None, hidden_rows: Tensor | None = None,
                   feature_layers: tuple[int, ...] = (), depth: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Feed ``lens[r]`` tokens (``tokens``: all of them, flat, on the model's device) after
    each sequence's committed tokens (reserved, not committed). Returns logits and hidden
    states for every fed row (``all_rows``), each request's last, or the fed rows ``rows``
    (flat indices) when given; hidden states of ``hidden_rows`` instead when given (the
    residual streams entering ``feature_layers``, concatenated, when named). A draft tree
    (``tree_mask``, `hal.engine.trees.layout`) gives each row its ``depth``: its position is its
    request's first fed position + depth. Reads nothing back from the device."""
    batch = make_batch(model.be, model.device, pool, seqs, lens, tokens, all_rows, rows, depth)
    batch.hidden_rows = None if hidden_rows is None else hidden_rows.to(model.device)
    batch.feature_layers = tuple(feature_layers)
    return model.forward(batch, pool.k, pool.v, tree_mask)


def make_batch(backend, dev, pool: kv.KVPool, seqs: list[kv.Sequence], lens: list[int], tokens: Tensor,
               all_rows: bool = False, rows: Tensor | None = None, depth: Tensor | None = None) -> Batch:
    """The `Batch` of one ragged forward over ``pool``: reserves ``lens[r]`` slots after each
    sequence's committed tokens (copying shared blocks first) and builds the metadata
    (positions: consecutive, or each request's first position + ``depth`` [T])."""
    slots, positions = [], []
    for seq, n in zip(seqs, lens):
        sl, copies = seq.reserve(n)
        if copies:
            src, dst = kv.block_copy_slots(copies, seq.block_size)
            for kc, vc in zip(pool.k, pool.v):
                backend.copy_kv(kc, vc, src.to(dev), dst.to(dev))
        slots += sl
        positions += range(seq.length, seq.length + n)
    qsl = torch.tensor([0] + lens).cumsum(0)
    if rows is None:
        rows = torch.arange(int(qsl[-1])) if all_rows else qsl[1:] - 1
    up = lambda x: torch.as_tensor(x).to(dev, non_blocking=True)  # noqa: E731
    pos = up(positions)
    if depth is not None:
        pos = torch.tensor([seq.length for seq, n in zip(seqs, lens) for _ in range(n)]).to(dev) + depth.to(dev)
    ends = tuple(seq.length + n for seq, n in zip(seqs, lens))
    return Batch(tokens=tokens, positions=pos, slot_mapping=up(slots),
                 block_tables=kv.block_tables(seqs).to(dev), seq_lens=up(list(ends)), seq_ends=ends,
                 query_start_loc=qsl.to(dev), logits_rows=rows.to(dev), max_position=max(positions, default=-1),
                 max_query=max(lens, default=0), min_context=min((seq.length for seq in seqs), default=0))


def sampling_tensors(params, repeats: list[int], dev) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row temperature, top-k and top-p: request i's values ``repeats[i]`` times."""
    rep = lambda vals, dt: torch.tensor([v for v, n in zip(vals, repeats) for _ in range(n)], dtype=dt).to(dev)  # noqa
    return (rep([p.temperature for p in params], torch.float32), rep([p.top_k for p in params], torch.int32),
            rep([p.top_p for p in params], torch.float32))


def sampling_args(states, repeats: list[int], dev, offsets: list[int] | None = None) -> tuple[Tensor, ...]:
    """Per-row temperature, top-k, top-p, and (with ``offsets``, one per request: the Philox
    offsets the engine spent for this draw) seed and offset."""
    params = sampling_tensors([s.req for s in states], repeats, dev)
    if offsets is None:
        return params
    rep = lambda vals: torch.tensor([v for v, n in zip(vals, repeats) for _ in range(n)]).to(dev)  # noqa: E731
    return (*params, rep([s.req.seed for s in states]), rep(offsets))


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, params=None) -> Tensor:
    """The target's p for verification: temperature, top-k and top-p applied, no draw spent
    (vLLM's ``compute_probs``; the same q the backends' `sample` returns, in plain torch).
    ``params``: the rows' sampling parameters on the host (then nothing is read back)."""
    from verify_ops.sample import probs, sort_width
    sort = None if params is None else sort_width([p.top_k for p in params], [p.top_p for p in params],
                                                  logits.shape[1])
    return probs(logits, temperature, top_k, top_p, sort)[0]


def logprob_rows(rows: Tensor, tokens: Tensor, top_n: int) -> list[Tensor]:
    """Device tensors for the emitted ``tokens`` (one per row of ``rows``): their logprob
    under log_softmax(rows) (vLLM's raw logprobs) and the ``top_n`` best (values, ids)."""
    lsm = torch.log_softmax(rows.float(), -1)
    out = [lsm.gather(1, tokens.long().clamp(min=0)[:, None])[:, 0]]
    if top_n:   # a stable sort: exact ties in the greedy order (the lower id first, as argmax picks); topk
        #          leaves their order, and which of them it keeps, open
        values, ids = torch.sort(lsm, stable=True, dim=-1, descending=True)
        out += [values[:, :top_n], ids[:, :top_n]]
    return out


def logprob_entry(got, r: int, token: int, want: int, top_n: int) -> TokenLogprob:
    """Row ``r``'s entry from a read-back `hal.engine.step_types.Logprobs` ``got``: the
    emitted token, its logprob and the ``want`` best alternatives of the ``top_n`` read."""
    top = []
    if want:   # best first, exact ties in the greedy order (`logprob_rows`)
        vals = got.top_values[r * top_n:r * top_n + want]
        ids = got.top_ids[r * top_n:r * top_n + want]
        top = [(int(i), v) for i, v in zip(ids, vals)]
    return TokenLogprob(token, got.logprob[r], top)


def readback(*tensors: Tensor) -> list[list]:
    """The one device-to-host transfer of a step: every tensor, flattened, in one copy
    (as float64, exact for token ids and counts below 2**53). Returns a list per tensor."""
    if not tensors:
        return []
    dev = tensors[0].device
    flat = torch.cat([transfer(t, dev).reshape(-1).to(torch.float64) for t in tensors])
    vals, out, i = (flat if flat.device.type == "cpu" else flat.cpu()).tolist(), [], 0
    for t in tensors:
        out.append(vals[i:i + t.numel()])
        i += t.numel()
    return out
