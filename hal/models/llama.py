"""A compact Llama-family runner (RMSNorm, RoPE, GQA attention, SwiGLU) over the HAL.

Attention goes through the backend's ``write_kv`` and ``paged_attention`` (the batch-invariant
default: the first layer's ``write_kv`` checked, then host KV writes in one native call each, and
`hal.models.invariant` attention; with the native layer loop, `hal.models.layer_loop`, every layer
in one call, its indices checked there); the batch is ragged, so prefill, decode and multi-token
verify share one forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError
from hal.models import int4, invariant, k_quants, layer_loop, q4_rows, row_kernels
from hal.models.families import qkv_extras, within_window
from hal.models.linear_layout import DTYPES, STORED_TYPES, LinearPlan, chunks, coded, form_of
from hal.models.linear_plan import choose_plan
from hal.models.rope import Rope


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_base: float
    eps: float
    rope_interleaved: bool  # GGUF (llama.cpp) permutes q/k for adjacent-pair rotation
    bos_id: int | None = None
    eos_id: int | None = None
    max_context: int | None = None   # the context it was trained to (None: the file does not say)
    # the family's differences from Llama 2 (transformers' config fields; `hal.models.hf`)
    family: str = "llama"
    qkv_bias: bool = False         # q, k, v projections have biases (Qwen2; Llama/Qwen3 attention_bias)
    o_bias: bool = False           # the output projection has one (Llama/Qwen3 attention_bias)
    qk_norm: bool = False          # per-head RMSNorm of q and k before RoPE (Qwen3)
    rope_scaling: dict | None = None   # llama3 frequency scaling (`hal.models.rope.Rope`)
    rope_factors: tuple[float, ...] | None = None   # the same, as a GGUF stores it (rope_freqs: divides each frequency)
    sliding_window: int | None = None  # attention window (Mistral): positions past it are refused
    eos_ids: tuple[int, ...] = ()  # every stop id (generation_config.json's list), eos_id first
    tied_head: bool = True         # the lm_head is the embedding where the file has none (HF: tie_word_embeddings)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.eos_ids) if self.eos_ids else (self.eos_id,) if self.eos_id is not None else ()


@dataclass
class Batch:
    """One ragged forward: ``tokens``/``positions`` [T], KV slots [T], per-request
    block tables, sequence lengths (after this step) and query offsets, and the token
    rows whose logits are wanted."""

    tokens: Tensor
    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    logits_rows: Tensor
    max_position: int | None = None  # max(positions) when the host knows it (no readback for the rope cache)
    max_query: int | None = None     # the longest request's fed tokens, when the host knows it
    min_context: int = 0             # a lower bound on every request's cached tokens before its fed ones
    seq_ends: tuple[int, ...] | None = None   # seq_lens on the host, when it knows them (no readback)
    hidden_rows: Tensor | None = None  # rows whose hidden states are returned (None: logits_rows)
    feature_layers: tuple[int, ...] = ()  # return the residual stream entering these layers, concatenated
    #                                       (EAGLE-3's features), instead of the final normed hidden state;
    #                                       increasing; the layer count taps the last layer's output


class Llama:
    """Weights plus a forward pass; ``num_layers < config.layers`` gives a
    self-speculative draft view that shares the weights (first L layers, final norm, head).

    ``batch_invariant`` (the default): linear layers and causal attention run in fixed shapes
    (`hal.models.invariant`, `hal.models.linear_plan`), so a token's logits are bit-identical
    whatever else is in the batch, and greedy speculative output equals plain greedy by
    construction. False: one ``F.linear`` per layer and the backend's ``paged_attention``.
    With a tree mask the caller gives each node its position (context + depth) in
    ``batch.positions``.

    ``plan``: how the linear layers run (layout, dtype, chunk widths); None measures one for
    these weights on this machine (`hal.models.linear_plan.choose_plan`, cached) among the
    dtypes ``dtype`` allows (``auto``: float32, or bfloat16 where it is faster and invariant;
    None: the dtype the weights already have, so models sharing a weight dict agree).
    ``fused_rows``: norms, SwiGLU, RoPE and attention as `hal.models.row_kernels` (one compiled
    call a step, on CPU) rather than eager ATen ops; ``native_loop``: with them, the layers
    in one native call where the weights run int4 (`hal.models.layer_loop`).
    The linear weights (and an lm_head copy) are cast to the plan's dtype once; embeddings,
    norms, the residual stream and the logits stay float32, and ``self.dtype`` is what the KV
    cache should hold."""

    def __init__(self, config: LlamaConfig, weights: dict[str, Tensor], backend, num_layers: int | None = None,
                 batch_invariant: bool = True, plan: LinearPlan | None = None, dtype: str | None = None,
                 plan_refresh: bool = False, fused_rows: bool = True, native_loop: bool = True):
        self.cfg, self.be, self.batch_invariant = config, backend, batch_invariant
        self.device = torch.device(backend.device_type)
        self.num_layers = config.layers if num_layers is None else num_layers
        if not 1 <= self.num_layers <= config.layers:
            raise HalError(f"num_layers: expected 1..{config.layers}, got {num_layers}")
        w = weights
        self.w = w
        self.embed = w["embed"]
        self.head = w.get("head", self.embed)
        self.head_t = w.setdefault("head_t", self.head.T.contiguous())  # [H, V]: the faster layout for M = 1
        self.rope = Rope(config.head_dim, config.rope_base, config.rope_interleaved, config.rope_scaling,
                         config.rope_factors).to(self.device)
        self.plan_choice = None
        if plan is None:
            weights = linear_weights(w, config.layers, self.head)
            q8, q6 = ([getattr(t, name, False) for t in weights] for name in ("q8", "q6k"))   # q4q8's Q8 / Q6 tiles
            packed = [isinstance(t, STORED_TYPES) and not (a or b) for t, a, b in zip(weights, q8, q6)]   # int4
            dtype = "stored" if any(packed + q8 + q6) else dtype or str(weights[0].dtype).removeprefix("torch.")
            if not batch_invariant and dtype not in ("auto", "stored"):   # plain F.linear: nothing to measure
                plan = LinearPlan("linear", DTYPES[dtype], (1,))
            else:
                stored = w.get("head_stored")   # a loader packed the file's Q8_0 / Q6_K head: it may run so
                forms = {form_of(t) for t in weights if isinstance(t, STORED_TYPES)}   # packed: in that form
                self.plan_choice = choose_plan([tuple(t.shape) for t in weights], dtype, weights=weights,
                                               refresh=plan_refresh, device=self.device, stored_int4=packed,
                                               stored_q8=q8, stored_q6=q6, q6k_head=getattr(stored, "q6k", False),
                                               q8_head=stored is not None and not getattr(stored, "q6k", False),
                                               form=forms.pop() if len(forms) == 1 else None)
                plan = self.plan_choice.plan
        self.plan = plan
        self._cast(plan.dtype)
        self.rows: row_kernels.Rows = row_kernels.rows_for(self.device) if fused_rows else row_kernels.EagerRows()
        self.loop = layer_loop.loop_for(self) if fused_rows and native_loop else None   # every layer natively

    def _raw_linear(self, x: Tensor, w) -> Tensor:
        return self.plan.linear(x, w, w.dtype)   # the product as computed: the row kernels take it as it is

    @property
    def dtype(self) -> torch.dtype:
        """The linear layers' (and the KV cache's) dtype."""
        return self.plan.dtype

    def _cast(self, dtype: torch.dtype) -> None:
        for i in range(self.cfg.layers):
            for name in LINEAR_KEYS:
                key = f"{i}.{name}"
                if isinstance(self.w[key], STORED_TYPES):
                    if form_of(self.w[key]) != self.plan.weights or self.w[key].dtype != dtype:
                        raise HalError(f"weights[{key!r}]: expected float weights or ones packed for {dtype} rows "
                                       f"in the plan's form ({self.plan.weights}), got {form_of(self.w[key])} "
                                       f"({self.w[key].dtype}) under {self.plan.describe()}", arg="weights")
                    self.w[key] = coded(self.w[key], self.plan.codes)
                elif self.w[key].dtype != dtype:
                    self.w[key] = self.w[key].to(dtype)
        if self.plan.head != "float":   # the loader packed the file's head as stored (`hal.models.loaders.load_gguf`)
            packed = self.w.get("head_stored")
            if form_of(packed) != self.plan.weights or packed.dtype != dtype:
                raise HalError(f"weights['head_stored']: expected the lm_head's stored codes packed for {dtype} rows "
                               f"under {self.plan.describe()}, got {getattr(packed, 'dtype', packed)}", arg="weights")
            self.head_lin = self.w["head_stored"] = coded(packed, self.plan.codes)
            return
        if self.w.get("head_lin") is None or self.w["head_lin"].dtype != dtype:
            self.w["head_lin"] = self.head if dtype == self.head.dtype else self.head.to(dtype)
        self.head_lin = self.w["head_lin"]

    def draft_linears(self, device: torch.device) -> tuple[Callable[[Tensor, Tensor], Tensor],
                                                           Callable[[Tensor, Tensor], Tensor], str]:
        """How a drafter of this target (an EAGLE head, a block drafter) on ``device`` runs its
        linear layers and its lm_head rows (``x @ w.T`` in ``w``'s dtype, returned as float32),
        and a line that says which. A batch-invariant target on the same device lends its plan:
        the layout, dtype and chunk widths measured fastest for this machine. Otherwise plain
        ``F.linear`` and `lm_head`: a plan is measured for its own device, and a plain target
        has none. Either way a draft's bits are not claimed independent of its batch-mates (the
        drafters' attention is the backend's op), and verification does not need them to be."""
        if self.batch_invariant and torch.device(device) == self.device:
            return self.plan.linear, self.plan.linear, f"the target's plan: {self.plan.describe()}"
        why = "the target runs plain" if not self.batch_invariant else f"the plan is for {self.device}"
        return plain_linear, lm_head, f"plain F.linear ({why})"

    def draft_weight(self, w: Tensor, device: torch.device):
        """A drafter's linear weight in the form its draft linears (`draft_linears`) run fastest: under a
        q4q8 plan on the drafter's device, Q8 tiles (quantized as Q8_0 is, `hal.models.q4_rows.quantize_q8`,
        rows of the plan's codes; a shape the kernel does not take stays float); else in the plan's dtype."""
        if self.plan.weights == "q4q8" and self.batch_invariant and torch.device(device) == self.device \
                and int4.fits(*w.shape):
            return coded(q4_rows.quantize_q8(w, self.plan.dtype), self.plan.codes)
        return w.to(self.dtype)

    def layer_view(self, num_layers: int) -> "Llama":
        view = Llama(self.cfg, self.w, self.be, num_layers, self.batch_invariant, plan=self.plan,
                     fused_rows=isinstance(self.rows, row_kernels.FusedRows), native_loop=self.loop is not None)
        view.device, view.rope, view.plan_choice, view.rows = self.device, self.rope, self.plan_choice, self.rows
        return view

    def to(self, device) -> "Llama":
        """Move the weights to ``device`` (a `hal.distributed.placement.Side` device of this backend)."""
        self.device = torch.device(device)
        for name, t in self.w.items():
            self.w[name] = t.to(self.device)
        self.embed, self.head, self.head_t = self.w["embed"], self.w.get("head", self.w["embed"]), self.w["head_t"]
        self.head_lin = self.w["head_stored" if self.plan.head != "float" else "head_lin"]
        self.rope.to(self.device)
        if isinstance(self.rows, row_kernels.FusedRows) and self.device.type != "cpu":
            self.rows, self.loop = row_kernels.EagerRows(), None
        return self

    def _attention_plan(self, batch: Batch, cache: Tensor, tree_mask: Tensor | None):
        """The batch-invariant attention's metadata for this forward: the fused kernel's key
        lists where the row kernels take this model's shapes and the caches are contiguous host
        tensors (the same for every forward of a model), else `invariant.Plan`."""
        cfg, T = self.cfg, batch.tokens.shape[0]
        max_query = batch.max_query
        if max_query is None:
            max_query = int((batch.query_start_loc[1:] - batch.query_start_loc[:-1]).max()) if T else 0
        if self.rows.attends(cfg.heads, cfg.kv_heads, cfg.head_dim) and cache.device.type == "cpu" \
                and cache.is_contiguous():
            return invariant.KeyLists(batch.block_tables, batch.seq_lens, batch.query_start_loc, T, max_query,
                                      tree_mask, batch.slot_mapping)
        return invariant.Plan(batch.block_tables, batch.seq_lens, batch.query_start_loc, T, cache.shape[1],
                              max_query, tree_mask, batch.min_context, batch.slot_mapping, batch.seq_ends)

    def _layer(self, i: int, h: Tensor, x: Tensor, rot: Tensor, k_cache: Tensor, v_cache: Tensor, batch: Batch,
               plan, tree_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Layer ``i`` after its attention norm ``x``: h with the attention's output added, and
        the MLP's output (added by the next layer's norm)."""
        cfg, rk, T = self.cfg, self.rows, x.shape[0]
        nq, nk, scale = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.head_dim ** -0.5
        lin = self._raw_linear if self.batch_invariant else plain_linear
        act = self.plan.dtype if self.batch_invariant else torch.float32
        fused = isinstance(plan, invariant.KeyLists)
        # the first layer goes through the checked ops; the rest reuse the same, now valid, metadata
        # (host KV writes in one call each: the fused `rope_kv`, or `invariant.write_kv`)
        ops = self.be if i == 0 else self.be.impl
        qkv = lin(x, self.w[f"{i}.wqkv"])
        if cfg.qkv_bias or cfg.qk_norm:
            qkv = qkv_extras(cfg, self.w, i, qkv, self.rows)
        if fused and i > 0:   # q rotated; k rotated and v written to the cache, in one call
            q = rk.rope_kv(qkv, rot, cfg.heads, cfg.kv_heads, cfg.rope_interleaved, k_cache, v_cache, plan.slot_of)
        else:
            q = rk.rope(qkv[:, :nq], rot, cfg.heads, cfg.rope_interleaved)
            k = rk.rope(qkv[:, nq:nq + nk], rot, cfg.kv_heads, cfg.rope_interleaved)
            v = qkv[:, nq + nk:].view(T, cfg.kv_heads, cfg.head_dim)
            if i == 0 or plan is None or not invariant.write_kv(plan, k, v, k_cache, v_cache):
                ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if fused:
            o = rk.attention(q, k_cache, v_cache, plan, scale)
        elif plan is not None:
            o = invariant.attention(q, k_cache, v_cache, plan, scale)
        else:
            o = ops.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                    scale, tree_mask)
        out = lin(o.reshape(T, nq), self.w[f"{i}.wo"])
        if cfg.o_bias:
            out = (out + self.w[f"{i}.bo"]).to(out.dtype)
        h, x = rk.add_norm(h, out, self.w[f"{i}.ffn_norm"], cfg.eps, act)
        return h, lin(rk.silu_mul(lin(x, self.w[f"{i}.wgu"])), self.w[f"{i}.wdown"])

    def _layers(self, h: Tensor, rot: Tensor, k_caches: list[Tensor], v_caches: list[Tensor], batch: Batch, plan,
                tree_mask: Tensor | None) -> tuple[Tensor, list[Tensor]]:
        """The layer stack from Python: h after the last layer's output is added, and h entering
        each layer of ``batch.feature_layers`` (the layer count: that final h)."""
        cfg, rk, d, taps = self.cfg, self.rows, None, []
        act = self.plan.dtype if self.batch_invariant else torch.float32    # the rows the linears take
        for i in range(self.num_layers):
            h, x = rk.add_norm(h, d, self.w[f"{i}.attn_norm"], cfg.eps, act)   # h += the last layer's output
            if i in batch.feature_layers:
                taps.append(h.clone())   # `FusedRows` adds into h in place
            h, d = self._layer(i, h, x, rot, k_caches[i], v_caches[i], batch, plan, tree_mask)
        h, _ = rk.add_norm(h, d, None, cfg.eps)
        if self.num_layers in batch.feature_layers:   # the final norm's input: the last layer's output
            taps.append(h)
        return h, taps

    def forward(self, batch: Batch, k_caches: list[Tensor], v_caches: list[Tensor],
                tree_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Logits [len(logits_rows), V] (fp32) and the final (normed) hidden states of those
        rows, or of ``batch.hidden_rows`` when given (an EAGLE head's features: every fed row,
        without paying the lm_head for them)."""
        cfg = self.cfg
        layers = list(batch.feature_layers)
        if layers != sorted(set(layers)) or any(not 0 <= i <= self.num_layers for i in layers):
            raise HalError(f"feature_layers: expected distinct layer indices in [0, {self.num_layers}] in order, "
                           f"got {batch.feature_layers}")   # before any KV write: a refused forward changes nothing
        T = batch.tokens.shape[0]
        if cfg.sliding_window is not None and T:
            within_window(cfg, batch)
        h = self.embed[batch.tokens]
        rot = self.rope(batch.positions, batch.max_position)
        scale = cfg.head_dim ** -0.5
        inv = self.batch_invariant
        plan = self._attention_plan(batch, k_caches[0], tree_mask) if inv else None
        fused = isinstance(plan, invariant.KeyLists)
        if fused and self.loop is not None:   # every layer in one native call (taps: the last layer's output too)
            h = h.contiguous()
            taps = self.loop.run(h, plan, rot, chunks(self.plan.widths, T, self.plan.costs), k_caches, v_caches,
                                 batch.feature_layers, cfg.eps, scale)
        else:
            h, taps = self._layers(h, rot, k_caches, v_caches, batch, plan, tree_mask)
            taps = torch.cat(taps, -1) if taps else None   # [T, len(taps) * H], as the native loop's
        _, out = self.rows.add_norm(h[batch.logits_rows], None, self.w["norm"], cfg.eps)
        if inv:
            logits = self.plan.linear(out, self.head_lin)
        elif self.head_lin.dtype == torch.float32:
            logits = lm_head(out, self.head, self.head_t)
        else:
            logits = plain_linear(out, self.head_lin)
        rows = batch.logits_rows if batch.hidden_rows is None else batch.hidden_rows
        if batch.feature_layers:
            out = taps[rows]
        elif batch.hidden_rows is not None:
            _, out = self.rows.add_norm(h[rows], None, self.w["norm"], cfg.eps)
        return logits, out


def lm_head(x: Tensor, w: Tensor, w_t: Tensor | None = None) -> Tensor:
    """``x @ w.T`` the fastest way MKL has on CPU: from ``[H, V]`` (``w_t``, or a view) for one
    row, as ``(w @ x.T).T`` for several (not batch-invariant: the plain path and draft heads)."""
    x = x.to(w.dtype)
    out = x @ (w.T if w_t is None else w_t) if x.shape[0] == 1 else torch.mm(w, x.T).T
    return out if out.dtype == torch.float32 else out.float()


def plain_linear(x: Tensor, w) -> Tensor:
    """``F.linear`` in the weight's dtype (a weight as stored: its kernel), returned as float32
    (the plain, not batch-invariant path)."""
    out = w.mm(x.to(w.dtype)) if isinstance(w, STORED_TYPES) else F.linear(x.to(w.dtype), w)
    return out if out.dtype == torch.float32 else out.float()


LINEAR_KEYS = ("wqkv", "wo", "wgu", "wdown")


def linear_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """The shapes of `linear_weights`, from the config alone (a plan chosen before loading)."""
    nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layer = [(nq + 2 * nk, cfg.hidden), (cfg.hidden, nq), (2 * cfg.ffn, cfg.hidden), (cfg.hidden, cfg.ffn)]
    return layer * cfg.layers + [(cfg.vocab, cfg.hidden)]


def linear_weights(w: dict[str, Tensor], layers: int, head: Tensor) -> list[Tensor]:
    """The weights a forward multiplies by, in order: each layer's fused qkv, o, gate-up and
    down projections, then the lm_head (what a linear plan is measured on)."""
    return [w[f"{i}.{name}"] for i in range(layers) for name in LINEAR_KEYS] + [head]


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, w.shape, w, eps)


def _fuse(w: dict, layers: int, dtype: torch.dtype | None = None, form: str = "int4") -> dict:
    """Fused projections (qkv, gate-up); weights kept as int4 blocks are packed for ``dtype``
    rows in the plan's ``form`` (``int4``: int4pack's; ``q4q8``: `hal.models.q4_rows` tiles)."""
    out = {"embed": w["embed"], "norm": w["norm"]}
    if "head" in w:
        out["head"] = w["head"]

    def join(*names):
        parts = [w[n] for n in names]
        if isinstance(parts[0], int4.Int4Blocks):
            blocks = int4.cat(parts)
            return q4_rows.pack(blocks, dtype) if form == "q4q8" else blocks.pack(dtype)
        if isinstance(parts[0], k_quants.CODES):   # Q8_0 and K-quants as stored: q4q8's Q8 / Q4K / Q6 tiles
            return k_quants.pack_parts(parts, dtype)
        return torch.cat(parts).contiguous() if len(parts) > 1 else parts[0].contiguous()

    for i in range(layers):
        out[f"{i}.attn_norm"], out[f"{i}.ffn_norm"] = w[f"{i}.attn_norm"], w[f"{i}.ffn_norm"]
        out[f"{i}.wqkv"] = join(f"{i}.wq", f"{i}.wk", f"{i}.wv")
        if f"{i}.bq" in w:   # the family's extras (`LlamaConfig.qkv_bias`, ...), float32
            out[f"{i}.bqkv"] = torch.cat([w[f"{i}.bq"], w[f"{i}.bk"], w[f"{i}.bv"]]).float().contiguous()
        for extra in ("bo", "q_norm", "k_norm"):
            if f"{i}.{extra}" in w:
                out[f"{i}.{extra}"] = w[f"{i}.{extra}"].float().contiguous()
        out[f"{i}.wgu"] = join(f"{i}.wgate", f"{i}.wup")
        out[f"{i}.wo"], out[f"{i}.wdown"] = join(f"{i}.wo"), join(f"{i}.wdown")
    return out


def random_llama(H: int, layers: int, heads: int, kv_heads: int, D: int, ffn: int, V: int, seed: int,
                 scale: float, embed_scale: float = 1.0, backend: str = "cpu", dtype: str = "float32",
                 fused_rows: bool = True) -> Llama:
    """A GGUF-style (interleaved RoPE) Llama with N(0, scale) weights and norms near 1 (tests and
    benchmarks that need a model of given shapes without a download)."""
    g = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(hidden=H, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=D, ffn=ffn, vocab=V,
                      rope_base=10000.0, eps=1e-5, rope_interleaved=True)
    w = {"embed": torch.randn(V, H, generator=g) * embed_scale, "norm": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(layers):
        w[f"{i}.attn_norm"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[f"{i}.ffn_norm"] = 1 + 0.1 * torch.randn(H, generator=g)
        w[f"{i}.wqkv"] = torch.randn((heads + 2 * kv_heads) * D, H, generator=g) * scale
        w[f"{i}.wo"] = torch.randn(H, heads * D, generator=g) * scale
        w[f"{i}.wgu"] = torch.randn(2 * ffn, H, generator=g) * scale
        w[f"{i}.wdown"] = torch.randn(H, ffn, generator=g) * scale
    import hal
    return Llama(cfg, w, hal.get_backend(backend), dtype=dtype, fused_rows=fused_rows)
