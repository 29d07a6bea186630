"""Batch-invariant building blocks of the runner (the default on every device; measured on CPU).

A token's logits must not depend on what else is in the batch: otherwise greedy speculative
output equals plain greedy only by luck (a near-tie flips when a 9-token verify rounds
differently from a 1-token decode). vLLM's batch-invariant mode fixes the reduction order per
output element; here the same comes from fixed shapes, checked bit for bit in
``tests/models/test_invariant.py``:

* linear layers: a `hal.models.linear_layout.LinearPlan` measured on this machine: a layout and
  dtype, each row computed in a chunk of exactly one of the widths whose rows were checked
  bit for bit against each other and independent of their batch-mates (zero-padded). Rows
  are only comparable at one thread count (the plan's signature names it).
* attention: each (request, query, KV head) is one bmm entry of G rows (the group's query heads)
  against keys padded to a multiple of 256; ``q.k`` is a 64-long dot product per score; masked
  scores are -inf before the softmax (trailing -inf change no row's sum); ``p @ V`` is summed in
  fixed 256-key blocks, so keys a query cannot see add exact zeros. A forward of one-token
  decodes only runs the same products without the per-query gathers and scatter.
* tree attention (a verify of a draft tree): a node's scores and values are taken in the order
  its path would have as a chain (context, then its ancestors by depth, then itself), so every
  node's row is the row a chain decode of its path computes (positions come from the caller).
* norms, RoPE, SwiGLU and residuals are per row or per element.
"""

from __future__ import annotations

import torch
from torch import Tensor

Q_CHUNK = 16          # query positions per attention chunk (bounds the scores' size; results do not depend on it)
KEY_BLOCK = 256       # keys per p @ V block


def _scratch(plan, name: str, shape, dtype, device) -> Tensor:
    buf = plan.buffers.get(name)
    if buf is None or buf.shape != torch.Size(shape) or buf.dtype != dtype:
        buf = plan.buffers[name] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def _gathered(plan, cache: Tensor, name: str) -> Tensor:
    """The batch's cached keys or values ``[R, Lp, Hkv, D]`` (cache dtype), gathered into a
    buffer this forward's layers share (no allocation per layer)."""
    nb, bs, Hkv, D = cache.shape
    out = _scratch(plan, name, (plan.flat_bt.numel(), bs * Hkv * D), cache.dtype, cache.device)
    torch.index_select(cache.view(nb, bs * Hkv * D), 0, plan.flat_bt, out=out)
    return out.view(plan.R, -1, Hkv, D)[:, :plan.Lp]


class Plan:
    """What the attention of one forward needs besides the layer's tensors: computed once per
    forward from the batch metadata (the same for every layer). ``min_context``: a lower bound
    on the cached tokens before any request's new ones (host-known; only a tree uses it)."""

    def __init__(self, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, T: int, bs: int,
                 max_query: int, tree_mask: Tensor | None = None, min_context: int = 0,
                 slot_mapping: Tensor | None = None, seq_ends: tuple[int, ...] | None = None):
        dev = block_tables.device
        self.slots, self.keep = host_slots(slot_mapping)
        R, nb = block_tables.shape
        qsl, seq = query_start_loc.long(), seq_lens.long()
        q_len = qsl[1:] - qsl[:-1]
        ctx = seq - q_len
        self.R, self.T = R, T
        # every request feeds exactly one token (host-known: T rows, R requests, none longer than
        # one): query rows are the requests in order, with no padding to mask or scatter
        self.decode_only = tree_mask is None and max_query == 1 and T == R
        self.Lp = -(-max(nb * bs, 1) // KEY_BLOCK) * KEY_BLOCK
        nbp = -(-self.Lp // bs)                                              # blocks covering Lp keys
        used = torch.arange(nbp, device=dev)[None] * bs < seq[:, None]
        bt = torch.nn.functional.pad(block_tables.long(), (0, nbp - nb))
        self.bt = torch.where(used, bt, 0)                                   # [R, nbp]: unused entries read block 0
        j = torch.arange(self.Lp, device=dev)
        self.flat_bt = self.bt.flatten()
        # with the lengths on the host (``seq_ends``) and host tensors, each request's values past its
        # end are one contiguous run of the gathered buffer: zeroed by one fill each (the broadcast
        # masked_fill cost 23 us a layer at one request, 155 us at eight); else by the mask ``dead``
        self.ends = seq_ends if seq_ends is not None and dev.type == "cpu" and len(seq_ends) == R else None
        self.dead = None if self.ends is not None else dead_mask(self.Lp, seq)
        self.buffers: dict[str, Tensor] = {}   # scratch reused by every layer of this forward
        self.chunks = []
        self.context_blocks = min_context // KEY_BLOCK    # key blocks before every request's new tokens
        for c0 in range(0, max(max_query, 0), Q_CHUNK):
            n = min(Q_CHUNK, max_query - c0)
            qi = c0 + torch.arange(n, device=dev)                             # local query index
            valid = qi[None] < q_len[:, None]                                # [R, n]
            rows = (qsl[:-1, None] + qi).clamp(max=max(T - 1, 0))
            order, seen = None, qi[None] + 1                                 # causal: itself and before
            if tree_mask is not None:   # the query's visible step tokens (ancestors, itself), in chain order
                m = tree_mask[rows][..., :max_query] & (torch.arange(max_query, device=dev) < q_len[:, None, None])
                seen = m.sum(-1)
                at = torch.where(m, ctx[:, None, None] + m.cumsum(-1) - 1, self.Lp)
                order = torch.arange(self.Lp + 1, device=dev).expand(R, n, self.Lp + 1).clone().scatter_(
                    2, at, (ctx[:, None, None] + torch.arange(max_query, device=dev)).expand(R, n, max_query))
                order = order[..., :self.Lp]                                 # chain slot -> key position
            see = (j[None, None] < (ctx[:, None] + seen)[..., None]) | ~valid[..., None]   # [R, n, Lp]
            self.chunks.append((n, rows, valid[..., None, None], see[:, None, :, None],
                                torch.where(valid, rows, T).flatten(), order))


def host_slots(slot_mapping: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """For `write_kv`: the slots of the tokens that are not padding (int64), and which tokens
    those are (None: all); (None, None) off the host, where the backend's op writes."""
    if slot_mapping is None or slot_mapping.device.type != "cpu":   # the mask costs no device sync
        return None, None
    rows = (slot_mapping >= 0).nonzero().squeeze(1)   # the tokens that are not padding (its shape: no read)
    keep = None if rows.shape[0] == slot_mapping.shape[0] else rows
    return (slot_mapping if keep is None else slot_mapping.index_select(0, rows)).long(), keep


class KeyLists:
    """The fused attention's metadata for one forward (`hal.models.row_kernels.FusedRows.attention`):
    each query row reads the first ``n_cache`` keys of its request in cache order (through
    ``block_tables``), then ``n_extra`` keys at the slots ``extra`` (a tree node's ancestors and
    itself, in chain order), so a node's row is its chain decode's row. Built with no host
    read; the kernel checks every index before it reads the cache.

    Shapes: ``block_tables`` [R, nb] int64; ``req``, ``n_cache``, ``n_extra`` [T] int64;
    ``extra`` [T, E] int64 (E >= 1); ``slot_of`` [T] int64: each row's KV slot (-1: padding),
    for the fused ``rope_kv`` (the first layer writes through the backend's checked op)."""

    def __init__(self, block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, T: int,
                 max_query: int, tree_mask: Tensor | None = None, slot_mapping: Tensor | None = None):
        R = block_tables.shape[0]
        qsl, seq = query_start_loc.long(), seq_lens.long()
        q_len = qsl[1:] - qsl[:-1]
        ctx = seq - q_len
        self.block_tables = block_tables.long().contiguous()
        self.req = torch.repeat_interleave(torch.arange(R), q_len, output_size=T)
        local = torch.arange(T) - qsl[:-1][self.req]                           # a row's index in its request
        self.extra = torch.zeros(T, 1, dtype=torch.long)
        if tree_mask is None:
            self.n_cache, self.n_extra = ctx[self.req] + local + 1, torch.zeros(T, dtype=torch.long)
        else:   # a node reads the context, then its visible step tokens in index (= chain) order
            steps = torch.arange(max_query)
            m = tree_mask[:, :max_query] & (steps[None] < q_len[self.req][:, None])
            self.n_cache, self.n_extra = ctx[self.req], m.sum(1)
            at = (qsl[:-1][self.req][:, None] + steps).clamp(max=max(T - 1, 0))
            step_slots = slot_mapping.long()[at]                                 # [T, max_query]
            self.extra = step_slots.gather(1, torch.argsort((~m).to(torch.uint8), dim=1, stable=True)).contiguous()
        self.slot_of = None if slot_mapping is None else slot_mapping.long().contiguous()   # [T], -1: padding


def dead_mask(Lp: int, seq: Tensor) -> Tensor:
    """``[R, Lp, 1, 1]``: True at each key position past its sequence's end (``seq`` [R])."""
    return (torch.arange(Lp, device=seq.device)[None] >= seq.long()[:, None])[..., None, None]


def _dead_zeroed(vals: Tensor, plan: Plan) -> Tensor:
    """The gathered values ``[R, Lp, Hkv, D]`` with every position past its sequence's end zeroed."""
    if plan.ends is None:
        return vals.masked_fill_(plan.dead, 0.0)
    for r, end in enumerate(plan.ends):
        if end < plan.Lp:
            vals[r, max(end, 0):].zero_()
    return vals


def write_kv(plan: Plan, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """The `hal.ops.Ops.write_kv` contract for a forward whose metadata the first layer's
    checked op already validated: on host tensors and contiguous caches, one ``index_copy_``
    per cache (no op dispatch per layer); False (nothing written) where it does not apply."""
    if plan.slots is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if plan.keep is not None:
        key, value = key.index_select(0, plan.keep), value.index_select(0, plan.keep)
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, plan.slots, key.to(k_cache.dtype))
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, plan.slots, value.to(v_cache.dtype))
    return True


def _decode(query: Tensor, kt: Tensor, blocks: list[Tensor], plan: Plan, scale: float) -> Tensor:
    """`attention` when every request feeds one token (`Plan.decode_only`): the same products
    in the same shapes, without the per-query gathers, stacks and scatter (bit for bit the
    general path's rows). ``kt`` [R * Hkv, D, Lp] (a transposed view); ``blocks`` [R, Hkv, 256, D]
    per key block."""
    T, Hq, D = query.shape
    G = Hq // (kt.shape[0] // T)
    s = torch.bmm(query.float().reshape(-1, G, D), kt).view(T, -1, 1, G, plan.Lp) * scale
    _, _, _, see, _, _ = plan.chunks[0]
    p = torch.softmax(torch.where(see, s, -torch.inf), -1)                   # [R, Hkv, 1, G, Lp]
    acc = None
    for b, k0 in enumerate(range(0, plan.Lp, KEY_BLOCK)):
        pv = torch.bmm(p[..., k0:k0 + KEY_BLOCK].reshape(-1, G, KEY_BLOCK), blocks[b].view(-1, KEY_BLOCK, D))
        acc = pv if acc is None else acc + pv
    return acc.view(T, Hq, D).to(query.dtype)


def attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, plan: Plan, scale: float) -> Tensor:
    """Causal paged attention over ragged queries (the `hal.ops.Ops.paged_attention` contract
    without a tree mask), computed in fixed shapes; ``plan`` holds the batch's metadata.

    Every (request, query, KV head) is its own bmm entry with the G query heads of that group
    as rows: the product's shape per entry never depends on the batch, and a decode query
    costs no padding. Each query position is one bmm over the batch's (request, KV head)
    entries, so keys and values are never copied per query; chunks of up to ``Q_CHUNK``
    positions bound the scores held at once.
    With a tree mask (in ``plan``) each query's scores are reordered, and its values gathered
    past the shared context blocks, into its path's chain order."""
    T, Hq, D = query.shape
    Hkv = k_cache.shape[2]
    G, R, Lp = Hq // Hkv, plan.R, plan.Lp
    # keys past a sequence's end are masked out of the scores; values there are zeroed, so that
    # p = 0 never meets a NaN left in a reused block
    dev, nblk = query.device, Lp // KEY_BLOCK
    # keys as [R, Hkv, Lp, D] rows, multiplied through a transposed view: the copy moves whole
    # 64-float rows, cheaper than transposing them into [D, Lp]; decode and verify multiply alike
    kr = _scratch(plan, "kr", (R, Hkv, Lp, D), torch.float32, dev)
    kr.copy_(_gathered(plan, k_cache, "k").permute(0, 2, 1, 3))
    kt_flat = kr.view(R * Hkv, Lp, D).transpose(1, 2)                          # [R * Hkv, D, Lp]
    vb = _scratch(plan, "vb", (nblk, R, Hkv, KEY_BLOCK, D), torch.float32, dev)   # [R, Hkv, 256, D] per key block
    vals = _dead_zeroed(_gathered(plan, v_cache, "v"), plan)
    vb.copy_(vals.reshape(R, nblk, KEY_BLOCK, Hkv, D).permute(1, 0, 3, 2, 4))
    blocks = list(vb.unbind(0))
    if plan.decode_only:
        return _decode(query, kt_flat, blocks, plan, scale)
    vals = vb.permute(1, 0, 3, 2, 4)                                         # [R, blocks, 256, Hkv, D] (a view)
    ar = torch.arange(R, device=dev)[:, None, None] if any(c[5] is not None for c in plan.chunks) else None
    out = query.new_empty(T + 1, Hq, D)       # row T takes the padding queries' outputs: no boolean indexing
    for n, rows, valid, see, dest, order in plan.chunks:
        q = torch.where(valid, query[rows].float(), 0.0).view(R, n, Hkv, G, D)    # [R, n, Hkv, G, D]
        # one bmm per query position: every entry is its G rows against its own keys, never a copy of them
        s = torch.stack([torch.bmm(q[:, i].reshape(R * Hkv, G, D), kt_flat) for i in range(n)], 1)
        s = s.view(R, Hkv, n, G, Lp) * scale
        if order is not None:   # each score is its own 64-long dot product: reorder them into chain order
            s = s.gather(-1, order[:, None, :, None].expand(R, Hkv, n, G, Lp))
        p = torch.softmax(torch.where(see, s, -torch.inf), -1)                   # [R, Hkv, n, G, Lp]
        acc = [None] * n
        for b, k0 in enumerate(range(0, Lp, KEY_BLOCK)):
            shared = order is None or b < plan.context_blocks   # context only: every query's order is the cache's
            if shared:
                vflat = blocks[b].view(R * Hkv, KEY_BLOCK, D)
            else:                                               # values gathered per query in its chain order
                at = order[..., k0:k0 + KEY_BLOCK]
                vq = vals[ar, at // KEY_BLOCK, at % KEY_BLOCK].permute(0, 3, 1, 2, 4)   # [R, Hkv, n, 256, D]
            for i in range(n):
                v = vflat if shared else vq[:, :, i].reshape(R * Hkv, KEY_BLOCK, D)
                pv = torch.bmm(p[:, :, i, :, k0:k0 + KEY_BLOCK].reshape(R * Hkv, G, KEY_BLOCK), v)
                acc[i] = pv if acc[i] is None else acc[i] + pv
        o = torch.stack(acc, 1).view(R, Hkv, n, G, D).permute(0, 2, 1, 3, 4).reshape(R * n, Hq, D)
        out[dest] = o.to(query.dtype)
    return out[:T]
