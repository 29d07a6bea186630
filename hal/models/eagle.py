"""EAGLE heads: one decoder layer that drafts from the target's features, with its own KV
cache, over a reduced draft vocabulary (EAGLE-3's ``d2t``, FR-Spec).

- EAGLE-1 (``layers.0.*``, ``fc [H, 2H]``): the input is ``fc(cat(embed(x_{t+1}), f_t))`` with
  f_t the target's final normed hidden state; the layer's output is the next feature (the head
  regresses it), so chained steps feed it back; logits = lm_head(output).
- EAGLE-3 (``midlayer.*``, ``fc [H, 3H]``): f_t is the residual stream entering three target
  layers (low, mid, high) fused by fc; the layer reads ``cat(norm(embed), hidden_norm(h))``
  (``[*, 2H]`` q/k/v); chained steps feed back the layer's output; logits = lm_head(norm(out)).

Pair (f_t, x_{t+1}) sits at position t of the head's KV. Target features are committed to
the head's KV once; its own draft steps are scratch, truncated at the next call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError
from hal.models import invariant, row_kernels
from hal.models.llama import Batch, Llama, _rms_norm
from hal.models.rope import Rope


@dataclass(frozen=True)
class EagleConfig:
    version: int                  # 1 or 3
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_base: float
    eps: float
    feature_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose input residual streams are the features
    draft_vocab: int | None = None        # None: the target's whole vocabulary
    rope_scaling: dict | None = None      # HF's rope_scaling (llama3 or none)
    qk_norm: bool = False                 # per-head RMSNorm of q and k (``q_norm``, ``k_norm``: Qwen3 layers)
    norm_before_residual: bool = False    # EAGLE-3: the residual is the normed feature (speculators' flag)


class EagleModel:
    """An EAGLE head's weights (internal names) and its forward over the head's own KV."""

    def __init__(self, cfg: EagleConfig, w: dict[str, Tensor], target: Llama, backend=None, device=None):
        self.be = backend or target.be     # a placement may put the head on another backend / device
        self.device = torch.device(device) if device is not None else (
            target.device if backend is None else torch.device(backend.device_type))
        self.cfg = cfg
        tc = target.cfg
        if cfg.hidden != tc.hidden:
            raise HalError(f"head hidden_size: expected the target's {tc.hidden}, got {cfg.hidden}")
        nf = len(cfg.feature_layers) if cfg.version == 3 else 2
        want = {"fc": (cfg.hidden, nf * cfg.hidden),
                "wqkv": ((cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, (2 if cfg.version == 3 else 1) * cfg.hidden),
                "wo": (cfg.hidden, cfg.heads * cfg.head_dim), "wgu": (2 * cfg.ffn, cfg.hidden),
                "wdown": (cfg.hidden, cfg.ffn)}
        for name, shape in want.items():
            if name not in w or tuple(w[name].shape) != shape:
                raise HalError(f"head weight {name}: expected shape {list(shape)}, got "
                               f"{list(w[name].shape) if name in w else 'nothing'}")
        self.w = {n: t.to(self.device, torch.float32) for n, t in w.items()}
        self.embed = self.w.get("embed", target.embed.to(self.device))
        ids = self.w.get("draft_ids")
        self.draft_ids = None if ids is None else ids.long().to(self.device)
        if "head" not in self.w:   # the target's lm_head, restricted to the draft vocabulary
            head = target.head.to(self.device)
            self.w["head"] = head if ids is None else head[self.draft_ids].contiguous()
        for name in ("fc", "wqkv", "wo", "wgu", "wdown", "head"):   # the linear layers run as the target's drafts do
            self.w[name] = target.draft_weight(self.w[name], self.device)
        self.head, self.vocab = self.w["head"], tc.vocab
        if self.draft_ids is not None and (self.draft_ids.min() < 0 or self.draft_ids.max() >= tc.vocab):
            raise HalError(f"head d2t: expected draft ids mapping into [0, {tc.vocab}), got "
                           f"[{int(self.draft_ids.min())}, {int(self.draft_ids.max())}]")
        self.rope = Rope(cfg.head_dim, cfg.rope_base, False, cfg.rope_scaling).to(self.device)
        self.linear, self.head_mm, self.linears = target.draft_linears(self.device)
        fused = isinstance(getattr(target, "rows", None), row_kernels.FusedRows) and self.device == target.device
        self.rows = target.rows if fused else None   # the target's fused row kernels, on its device

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.feature_layers if self.cfg.version == 3 else ()

    def fuse(self, x: Tensor) -> Tensor:
        """Target features [T, F] as the head's own features [T, H] (what ``forward`` makes of
        them with ``from_target``: EAGLE-3's fc; EAGLE-1 reads them as they are)."""
        return self.linear(x, self.w["fc"]) if self.cfg.version == 3 else x

    def forward(self, batch: Batch, k_cache: Tensor, v_cache: Tensor, tokens: Tensor, x: Tensor,
                from_target: bool, tree_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Draft-vocabulary logits [len(logits_rows), Vd] and the layer's output [T, H] (the
        next feature) for pairs (x: a feature per row, tokens: the token after it).
        ``from_target``: x is the target's feature (EAGLE-3 fuses it with fc); else it is the
        head's own previous output."""
        cfg, w = self.cfg, self.w
        T = tokens.shape[0]
        e, lin = self.embed[tokens], self.linear
        if cfg.version == 1:
            h = lin(torch.cat([e, x], -1), w["fc"]) + (w["fc_bias"] if "fc_bias" in w else 0)
            inp = h if "attn_norm" not in w else _rms_norm(h, w["attn_norm"], cfg.eps)
        else:
            h = self.fuse(x) if from_target else x
            hn = _rms_norm(h, w["hidden_norm"], cfg.eps)
            inp = torch.cat([_rms_norm(e, w["attn_norm"], cfg.eps), hn], -1)
            h = hn if cfg.norm_before_residual else h
        nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qkv = lin(inp, w["wqkv"])
        if cfg.qk_norm:
            D = cfg.head_dim
            qkv = torch.cat([_rms_norm(qkv[:, :nq].reshape(T, -1, D), w["q_norm"], cfg.eps).reshape(T, nq),
                             _rms_norm(qkv[:, nq:nq + nk].reshape(T, -1, D), w["k_norm"], cfg.eps).reshape(T, nk),
                             qkv[:, nq + nk:]], -1)
        rot = self.rope(batch.positions, batch.max_position)
        if self._fused(k_cache):   # the target's row kernels: RoPE, the KV write and the attention in C
            o = self._fused_attention(batch, qkv, rot, k_cache, v_cache, tree_mask)
        else:
            q = self.rope.apply(qkv[:, :nq].view(T, cfg.heads, cfg.head_dim), rot)
            k = self.rope.apply(qkv[:, nq:nq + nk].view(T, cfg.kv_heads, cfg.head_dim), rot)
            v = qkv[:, nq + nk:].view(T, cfg.kv_heads, cfg.head_dim)
            self.be.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
            o = self.be.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                        batch.query_start_loc, cfg.head_dim ** -0.5, tree_mask)
        h = h + lin(o.reshape(T, nq), w["wo"])
        gate, up = lin(_rms_norm(h, w["ffn_norm"], cfg.eps), w["wgu"]).split(cfg.ffn, -1)
        h = h + lin(F.silu(gate) * up, w["wdown"])
        out = h[batch.logits_rows]
        if cfg.version == 3:
            out = _rms_norm(out, w["norm"], cfg.eps)
        return self.head_mm(out, self.head), h

    def _fused(self, k_cache: Tensor) -> bool:
        """Whether this forward runs on the target's fused row kernels: they are loaded, take
        these heads, and the cache is a contiguous host tensor."""
        cfg = self.cfg
        return self.rows is not None and self.rows.attends(cfg.heads, cfg.kv_heads, cfg.head_dim) \
            and k_cache.device.type == "cpu" and k_cache.is_contiguous()

    def _fused_attention(self, batch: Batch, qkv: Tensor, rot: Tensor, k_cache: Tensor, v_cache: Tensor,
                         tree_mask: Tensor | None) -> Tensor:
        """The attention's output [T, heads, D] by the row kernels, in the order the backend's
        ops ran: `rope_kv` checks every slot before it writes (a bad slot writes nothing), then
        `attention` checks every index before it reads."""
        cfg, T = self.cfg, qkv.shape[0]
        max_query = batch.max_query
        if max_query is None:
            max_query = int((batch.query_start_loc[1:] - batch.query_start_loc[:-1]).max()) if T else 0
        keys = invariant.KeyLists(batch.block_tables, batch.seq_lens, batch.query_start_loc, T, max_query, tree_mask,
                                  batch.slot_mapping)
        q = self.rows.rope_kv(qkv, rot, cfg.heads, cfg.kv_heads, False, k_cache, v_cache, keys.slot_of)
        return self.rows.attention(q, k_cache, v_cache, keys, cfg.head_dim ** -0.5)

    def full_logits(self, draft_logits: Tensor) -> Tensor:
        """Draft-vocabulary logits spread over the target's vocabulary (-inf elsewhere)."""
        if self.draft_ids is None:
            return draft_logits
        out = draft_logits.new_full((draft_logits.shape[0], self.vocab), float("-inf"))
        out[:, self.draft_ids] = draft_logits
        return out


# -- heads shipped with the package ----------------------------------------------------------------

SHIPPED = {   # model name -> (folder under hal/models/heads, sha256 of its model.safetensors)
    "smollm2-135m": ("smollm2-135m-eagle", "6dd3b8cb86e80a88c42265a680428865fc8576d014194282f293d25e232e1ca6"),
}


def shipped_head(model: str) -> Path:
    """The folder of the head shipped for ``model``, its weights' sha256 checked (`hal.models.shipped`)."""
    from hal.models.shipped import shipped_folder
    return shipped_folder(SHIPPED, model, "eagle", "head")
