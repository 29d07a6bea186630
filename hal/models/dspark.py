"""A block drafter in the published architectures (`hal.models.block_layouts` reads their
folders): Qwen3 layers that propose a whole block in one forward pass (z-lab's DFlash) and, in
DeepSeek's DSpark (arXiv 2607.05147), a low-rank Markov head that links the block's positions
left to right and a confidence head that predicts each position's acceptance.

Glossary:
- anchor: the last committed token (position ``L - 1`` of a request with ``L`` tokens); the
  block is ``[anchor, mask x (B - 1)]`` at positions ``L - 1 .. L + B - 2`` (the mask rows: the
  embedding of the layout's ``mask_token_id``). In DFlash row j >= 1 proposes the token at
  position ``L - 1 + j`` (B - 1 proposals); in DSpark (``anchor_predicts``) row j proposes
  position ``L + j``, the anchor's row too (B proposals).
- context features: the residual streams entering the target layers ``taps`` at positions
  ``0 .. L - 2`` (the rows the target has verified; tap ``layers``, the target's layer count, is
  the last layer's output), fused by ``fc`` and ``hidden_norm``; each draft layer projects them
  with its own k/v weights into its KV (positions as in the target). Only these are kept per
  request (the drafter's context cache); the block's own K/V are scratch, dropped at the next
  call, so a rejection needs no rollback.
- base logits: ``lm_head(norm(h_j))`` over the draft vocabulary (the lm_head rows ``draft_ids``:
  a token map's, else the whole vocabulary), from one forward for every position at once.
- Markov bias: ``markov_out @ markov_w1[x_{j-1}]``, rank r (a table by token), added to
  position j's base logits once the token before it (x_0 = the anchor) is drawn: the draft is
  sampled left to right from these rows, and exactly these rows are its q.
- confidence: ``sigmoid(conf . [h_j, markov_w1[x_{j-1}]] + conf_bias)`` (or of h_j alone), the
  predicted chance that position j is accepted given that every position before it was. It
  reads the tokens before j only, never the token drawn at j.

Attention: block queries see every context position and the whole block (non-causal, a
tree mask of ones over the block)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError
from hal.models import invariant, row_kernels
from hal.models.llama import Batch, Llama, _rms_norm
from hal.models.rope import Rope


class Confidence(IntEnum):
    """What the confidence head reads besides the position's hidden state h_j."""
    NONE = 0     # no confidence head (DFlash): every proposal is offered to the router
    MARKOV = 1   # [h_j, markov_w1[x_{j-1}]] -> conf [H + r] (DeepSpec, confidence_head_with_markov)
    HIDDEN = 2   # h_j alone -> conf [H] (DeepSpec without the Markov input)


@dataclass(frozen=True)
class DSparkConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int                # draft layers
    taps: tuple[int, ...]      # target layers whose input residual streams are the context features
    #                            (the target's layer count: the last layer's output)
    block: int                 # B: the anchor plus B - 1 mask rows
    rank: int                  # the Markov head's rank r (0: none)
    draft_vocab: int
    rope_base: float = 10000.0
    eps: float = 1e-6
    anchor_predicts: bool = True    # row j proposes position L + j, the anchor's row too (B proposals:
    #                                 DeepSpec's DSpark), else row j >= 1 proposes L - 1 + j (B - 1: DFlash)
    confidence: Confidence = Confidence.MARKOV

    def __post_init__(self):
        object.__setattr__(self, "confidence", Confidence(self.confidence))

    @property
    def proposals(self) -> int:
        return self.block if self.anchor_predicts else self.block - 1

    def shapes(self, vocab: int = 0) -> dict[str, tuple[int, ...]]:
        """Every weight's shape under its internal name (``draft_ids`` aside; ``vocab``: the
        target's, the rows of a ``markov_w1`` table)."""
        H, nq, nk, r = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.rank
        out = {"fc": (H, len(self.taps) * H), "hidden_norm": (H,), "mask": (H,), "norm": (H,)}
        if r:
            out.update({"markov_w1": (vocab, r), "markov_out": (self.draft_vocab, r)})
        if self.confidence != Confidence.NONE:
            out["conf"] = (H + (r if self.confidence == Confidence.MARKOV else 0),)
            out["conf_bias"] = (1,)
        for i in range(self.layers):
            out.update({f"{i}.attn_norm": (H,), f"{i}.wqkv": (nq + 2 * nk, H), f"{i}.wo": (H, nq),
                        f"{i}.ffn_norm": (H,), f"{i}.wgu": (2 * self.ffn, H), f"{i}.wdown": (H, self.ffn),
                        f"{i}.q_norm": (self.head_dim,), f"{i}.k_norm": (self.head_dim,)})
        return out


LINEAR = ("wqkv", "wo", "wgu", "wdown")


class DSparkModel:
    """A block drafter's weights and its forward over its own context cache (a `hal.kv.KVPool`
    with ``cfg.layers`` layers), for ``target`` (its embeddings and lm_head rows)."""

    def __init__(self, cfg: DSparkConfig, w: dict[str, Tensor], target: Llama, backend=None, device=None):
        self.be = backend or target.be
        self.device = torch.device(device) if device is not None else (
            target.device if backend is None else torch.device(backend.device_type))
        tc = target.cfg
        if cfg.hidden != tc.hidden:
            raise HalError(f"block drafter hidden: expected the target's {tc.hidden}, got {cfg.hidden}")
        if any(not 0 <= t <= tc.layers for t in cfg.taps) or list(cfg.taps) != sorted(set(cfg.taps)):
            raise HalError(f"block drafter taps: expected increasing layers in [0, {tc.layers}], got {cfg.taps}")
        if cfg.block < 2:
            raise HalError(f"block drafter block: expected >= 2 (the anchor and a proposal), got {cfg.block}")
        for name, shape in cfg.shapes(tc.vocab).items():
            if name not in w or tuple(w[name].shape) != shape:
                raise HalError(f"block drafter weight {name}: expected shape {list(shape)}, got "
                               f"{list(w[name].shape) if name in w else 'nothing'}")
        ids = w.get("draft_ids")
        if ids is None or tuple(ids.shape) != (cfg.draft_vocab,) or ids.min() < 0 or ids.max() >= tc.vocab:
            raise HalError(f"block drafter draft_ids: expected {cfg.draft_vocab} ids in [0, {tc.vocab}), got "
                           f"{None if ids is None else list(ids.shape)}")
        for name in ("embed", "head"):   # a layout's own copies (DeepSpec ships the target's), else the target's
            if name in w and tuple(w[name].shape) != (tc.vocab, cfg.hidden):
                raise HalError(f"block drafter weight {name}: expected the target's vocabulary and hidden size "
                               f"{[tc.vocab, cfg.hidden]}, got {list(w[name].shape)}")
        self.cfg, self.vocab = cfg, tc.vocab
        self.w = {n: t.to(self.device, torch.float32) for n, t in w.items() if n not in ("draft_ids", "embed", "head")}
        self.draft_ids = ids.long().to(self.device)
        self.embed = w["embed"].to(self.device, torch.float32) if "embed" in w else target.embed.to(self.device)
        head = w["head"].to(self.device, torch.float32) if "head" in w else target.head.to(self.device)
        self.w["head"] = head[self.draft_ids].contiguous()
        nq = cfg.heads * cfg.head_dim
        for i in range(cfg.layers):   # the linear layers run as the target's drafts do (its draft_weight)
            self.w[f"{i}.wkv"] = self.w[f"{i}.wqkv"][nq:]   # the context rows' keys and values alone
            for name in (*LINEAR, "wkv"):
                self.w[f"{i}.{name}"] = target.draft_weight(self.w[f"{i}.{name}"], self.device)
        for name in ("fc", "head"):
            self.w[name] = target.draft_weight(self.w[name], self.device)
        self.rope = Rope(cfg.head_dim, cfg.rope_base, False).to(self.device)
        self.linear, self.head_mm, self.linears = target.draft_linears(self.device)
        fused = isinstance(getattr(target, "rows", None), row_kernels.FusedRows) and self.device == target.device
        self.rows = target.rows if fused else None   # the target's fused row kernels, on its device

    @property
    def proposals(self) -> int:
        """Tokens one forward proposes (B - 1, or B where the anchor's row proposes too)."""
        return self.cfg.proposals

    def forward(self, batch: Batch, k_caches: list[Tensor], v_caches: list[Tensor], feats: Tensor,
                ctx_rows: Tensor, block_rows: Tensor, anchors: Tensor, block_batch: Batch) -> tuple[Tensor, Tensor]:
        """Base logits [R, P, Vd] and hidden states [R, P, H] of each drafting request's block's
        P = `proposals` proposing rows.

        ``batch``: every fed row (each request's new context rows, then, for the R requests that
        draft, its B block rows, at consecutive positions) with its KV slot; ``ctx_rows`` /
        ``block_rows`` index them (``feats`` [len(ctx_rows), len(taps) * H] are the context rows'
        features, ``anchors`` [R] the blocks' first tokens). ``block_batch``: the attention
        metadata of the R blocks' queries alone (B each, a tree mask of ones). With R = 0 only
        the context is written (a request routed to k = 0 keeps its cache for later)."""
        cfg, w, lin = self.cfg, self.w, self.linear
        nq, nk, D = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.head_dim
        R, B = anchors.shape[0], cfg.block
        ctx = _rms_norm(lin(feats, w["fc"]), w["hidden_norm"], cfg.eps) if len(ctx_rows) else None
        if R == 0:
            return self._write_context(batch, k_caches, v_caches, ctx)
        first = self.embed[anchors]
        h = torch.cat([first[:, None], w["mask"].expand(R, B - 1, cfg.hidden)], 1).reshape(R * B, -1)
        rot = self.rope(batch.positions, batch.max_position)
        rot_blk = rot[block_rows]
        T = batch.positions.shape[0]
        ones = torch.ones(R * B, B, dtype=torch.bool, device=self.device)
        for i in range(cfg.layers):
            qkv = lin(_rms_norm(h, w[f"{i}.attn_norm"], cfg.eps), w[f"{i}.wqkv"])
            k = qkv.new_empty(T, cfg.kv_heads, D)
            v = qkv.new_empty(T, cfg.kv_heads, D)
            k[block_rows] = self.rope.apply(self._norm(qkv[:, nq:nq + nk].view(-1, cfg.kv_heads, D), i, "k"), rot_blk)
            v[block_rows] = qkv[:, nq + nk:].view(-1, cfg.kv_heads, D)
            if ctx is not None:
                kv = lin(ctx, w[f"{i}.wkv"])
                k[ctx_rows] = self.rope.apply(self._norm(kv[:, :nk].view(-1, cfg.kv_heads, D), i, "k"), rot[ctx_rows])
                v[ctx_rows] = kv[:, nk:].view(-1, cfg.kv_heads, D)
            self.be.write_kv(k.to(k_caches[i].dtype), v.to(v_caches[i].dtype), k_caches[i], v_caches[i],
                             batch.slot_mapping)
            q = self.rope.apply(self._norm(qkv[:, :nq].view(-1, cfg.heads, D), i, "q"), rot_blk)
            o = self._attention(q, k_caches[i], v_caches[i], block_batch, ones, batch.slot_mapping[block_rows])
            h = h + lin(o.reshape(R * B, nq), w[f"{i}.wo"])
            gate, up = lin(_rms_norm(h, w[f"{i}.ffn_norm"], cfg.eps), w[f"{i}.wgu"]).split(cfg.ffn, -1)
            h = h + lin(F.silu(gate) * up, w[f"{i}.wdown"])
        P = cfg.proposals
        out = _rms_norm(h.view(R, B, -1)[:, B - P:], w["norm"], cfg.eps)
        return self.head_mm(out.reshape(R * P, -1), w["head"]).view(R, P, -1), out

    def _norm(self, x: Tensor, i: int, which: str) -> Tensor:
        """Layer i's per-head RMSNorm of q or k ([T, heads, D])."""
        return _rms_norm(x, self.w[f"{i}.{which}_norm"], self.cfg.eps)

    def _attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, blocks: Batch, ones: Tensor,
                   slots: Tensor) -> Tensor:
        """The block queries' attention (each sees its context and its whole block): on the
        target's fused row kernels where they apply (every index checked before the cache is
        read), else the backend's ``paged_attention``. ``slots``: the block rows' KV slots."""
        cfg = self.cfg
        if self.rows is not None and self.rows.attends(cfg.heads, cfg.kv_heads, cfg.head_dim) \
                and k_cache.device.type == "cpu" and k_cache.is_contiguous():
            keys = invariant.KeyLists(blocks.block_tables, blocks.seq_lens, blocks.query_start_loc, q.shape[0],
                                      cfg.block, ones, slots)
            return self.rows.attention(q.float(), k_cache, v_cache, keys, cfg.head_dim ** -0.5)
        return self.be.paged_attention(q.to(k_cache.dtype), k_cache, v_cache, blocks.block_tables, blocks.seq_lens,
                                       blocks.query_start_loc, cfg.head_dim ** -0.5, ones)

    def _write_context(self, batch: Batch, k_caches, v_caches, ctx: Tensor | None) -> tuple[Tensor, Tensor]:
        """Every fed row is a context row: each layer's K/V of the fused features, written; no block."""
        cfg, w, lin = self.cfg, self.w, self.linear
        nk, D = cfg.kv_heads * cfg.head_dim, cfg.head_dim
        if ctx is not None:
            rot = self.rope(batch.positions, batch.max_position)
            for i in range(cfg.layers):
                kv = lin(ctx, w[f"{i}.wkv"])
                k = self.rope.apply(self._norm(kv[:, :nk].view(-1, cfg.kv_heads, D), i, "k"), rot)
                self.be.write_kv(k.to(k_caches[i].dtype), kv[:, nk:].reshape(-1, cfg.kv_heads, D).to(v_caches[i].dtype),
                                 k_caches[i], v_caches[i], batch.slot_mapping)
        none = torch.zeros(0, cfg.proposals, 1, device=self.device)
        return none.expand(0, cfg.proposals, cfg.draft_vocab), none.expand(0, cfg.proposals, cfg.hidden)

    def markov(self, prev: Tensor) -> Tensor | None:
        """The Markov head's logit bias [R, Vd] for the positions after tokens ``prev`` [R]
        (target ids); None without a Markov head (rank 0)."""
        if not self.cfg.rank:
            return None
        return self.w["markov_w1"][prev] @ self.w["markov_out"].T

    def confidence(self, h: Tensor, prev: Tensor) -> Tensor | None:
        """Predicted acceptance [R] of a position from its hidden state [R, H] and the token
        before it ``prev`` [R] (`Confidence`); None without a confidence head."""
        c, w = self.cfg.confidence, self.w
        if c == Confidence.NONE:
            return None
        x = h if c == Confidence.HIDDEN else torch.cat([h, w["markov_w1"][prev]], -1)
        return torch.sigmoid(x @ w["conf"] + w["conf_bias"])

    def full_logits(self, draft_logits: Tensor) -> Tensor:
        """Draft-vocabulary logits spread over the target's vocabulary (-inf elsewhere)."""
        out = draft_logits.new_full((draft_logits.shape[0], self.vocab), float("-inf"))
        out[:, self.draft_ids] = draft_logits
        return out


SHIPPED = {   # model name -> (folder under hal/models/heads, sha256 of its model.safetensors)
    "smollm2-135m": ("smollm2-135m-dspark", "621bc8bc73f90448727b6c1995b81a6ee4a9e258ecd0b0f33653968a55c340d5"),
}


def shipped_block(model: str) -> Path:
    """The block drafter shipped for ``model``, its weights' sha256 checked (`hal.models.shipped`)."""
    from hal.models.shipped import shipped_folder
    return shipped_folder(SHIPPED, model, "dspark", "block drafter")
