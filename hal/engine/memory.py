"""Memory planning for a draft and a target, before anything is allocated.

Per device: the weights placed there + each KV pool placed there (whole blocks of the
backend's block size, head_dim checked against its alignment) + activation headroom,
against a budget (a fraction of the device's memory, or explicit bytes: required on
cpu, which cannot report a device budget). `plan_memory` refuses an impossible plan
with a `HalError` that says what to change; `Plan.allocate` then creates the pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hal.errors import HalError, arg_error
from hal.kv import KVPool

GiB = 1 << 30


@dataclass(frozen=True)
class ModelMemory:
    """What the planner needs to know about one model."""

    name: str
    weight_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    kv_dtype: torch.dtype = torch.float32
    feature_bytes: int = 0   # per position: the target features a prefix-cached block keeps (`hal.engine.feature_cache`)

    @classmethod
    def of(cls, model, name: str, share_weights_with=None) -> "ModelMemory":
        """From a `hal.models.llama.Llama`; a layer view of ``share_weights_with`` owns no weights."""
        c = model.cfg
        shared = share_weights_with is not None and model.w is share_weights_with.w
        wb = 0 if shared else sum(t.numel() * t.element_size() for t in {id(t): t for t in model.w.values()}.values())
        return cls(name, wb, model.num_layers, c.kv_heads, c.head_dim, c.hidden, c.ffn, c.vocab,
                   getattr(model, "dtype", torch.float32))

    @classmethod
    def from_config(cls, cfg, name: str, layers: int | None = None, owns_weights: bool = True,
                    kv_dtype: torch.dtype = torch.float32) -> "ModelMemory":
        """From a `hal.models.llama.LlamaConfig`, before any weight is loaded (``layers``:
        a self-speculative view's depth; ``kv_dtype``: the linear plan's dtype)."""
        return cls(name, _weight_bytes(cfg) if owns_weights else 0, layers or cfg.layers, cfg.kv_heads, cfg.head_dim,
                   cfg.hidden, cfg.ffn, cfg.vocab, kv_dtype)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.kv_dtype).element_size()

    def token_bytes(self) -> int:
        """What a pool position costs: its KV, plus the feature rows kept with it."""
        return self.kv_bytes_per_token() + self.feature_bytes


@dataclass
class PoolPlan:
    model: str
    side: object  # hal.distributed.placement.Side
    block_size: int
    num_blocks: int
    block_bytes: int
    mem: ModelMemory


@dataclass
class DevicePlan:
    device: str
    budget: int
    weights: int = 0
    headroom: int = 0
    kv: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.headroom + self.kv


@dataclass
class Plan:
    devices: dict[str, DevicePlan]
    pools: dict[str, PoolPlan]
    max_seqs: int
    max_context: int
    capacity: dict[str, int] = field(default_factory=dict)  # sequences of max_context each pool can hold

    def report(self) -> str:
        lines = []
        for d in self.devices.values():
            lines.append(f"{d.device}: budget {d.budget / GiB:.2f} GiB = weights {d.weights / GiB:.3f} + KV "
                         f"{d.kv / GiB:.3f} + headroom {d.headroom / GiB:.3f} + free {(d.budget - d.total) / GiB:.3f}")
        for name, p in self.pools.items():
            feats = " (with their cached target features)" if p.mem.feature_bytes else ""
            lines.append(f"{name} KV: {p.num_blocks} blocks x {p.block_size} tokens{feats} on {p.side.device} "
                         f"({p.side.backend.name}); holds {self.capacity[name]} sequences x {self.max_context} tokens")
        lines.append(f"max concurrent sequences x context: {min(self.capacity.values())} x {self.max_context}")
        return "\n".join(lines)

    def allocate(self, name: str) -> KVPool:
        """The KV pool for ``"target"`` or ``"draft"`` (only after the plan has passed)."""
        p = self.pools[name]
        return KVPool(p.side.backend, p.num_blocks, p.block_size, p.mem.kv_heads, p.mem.head_dim, p.mem.kv_dtype,
                      p.mem.layers, device=p.side.device)


def target_pool(target, num_blocks: int, block_size: int = 16) -> KVPool:
    """A KV pool of ``num_blocks`` blocks for ``target`` (a `hal.models.llama.Llama`), at its
    dtype and on its device, without a plan (tests, benchmarks, small local engines)."""
    cfg = target.cfg
    return KVPool(target.be, num_blocks, block_size, cfg.kv_heads, cfg.head_dim,
                  dtype=getattr(target, "dtype", torch.float32), num_layers=cfg.layers, device=target.device)


def default_block_size(backend) -> int:
    """The smallest supported block size >= 16 (vLLM's default), else the smallest supported."""
    sizes = [b for b in range(1, 1025) if b in backend.spec.block_sizes]
    if not sizes:
        raise HalError(f"backend {backend.name}: supports no block size up to 1024")
    return next((b for b in sizes if b >= 16), sizes[0])


def headroom_bytes(mem: ModelMemory, max_batch_tokens: int, logits_rows: int) -> int:
    """Activations of one forward over ``max_batch_tokens`` (fp32 residual, qkv, attention
    output, gate/up) plus fp32 logits, probabilities and a softmax temporary per row."""
    act = max_batch_tokens * (3 * mem.hidden + 2 * mem.ffn + 2 * mem.kv_heads * mem.head_dim) * 4
    return act + 3 * logits_rows * mem.vocab * 4


def plan_memory(target: ModelMemory | None, target_side, draft: ModelMemory | None = None, draft_side=None, *,
                max_seqs: int, max_context: int, max_k: int = 8, budget_fraction: float = 0.9,
                budget_bytes: dict[str, int] | None = None, block_size: dict[str, int] | None = None,
                extra_headroom: int = 0, fill: bool = False) -> Plan:
    """Plan the target (and optional draft model) on their sides for ``max_seqs``
    concurrent sequences of up to ``max_context`` tokens each, verifying up to ``max_k``
    drafts per step. Raises `HalError` if it cannot fit; allocates nothing. The pools hold
    exactly that (``fill=True``: all the budget leaves, as vLLM sizes its KV cache);
    ``Plan.capacity`` says how many such sequences the budget could hold."""
    for name, v in (("max_seqs", max_seqs), ("max_context", max_context)):
        if not isinstance(v, int) or v < 1:
            raise arg_error(name, "an int >= 1", v)
    if not 0 < budget_fraction <= 1:
        raise arg_error("budget_fraction", "a fraction in (0, 1]", budget_fraction)
    budget_bytes, block_size = budget_bytes or {}, block_size or {}
    sides = [(n, m, sd) for n, m, sd in (("target", target, target_side), ("draft", draft, draft_side))
             if m is not None]
    if not sides:
        raise arg_error("target", "a ModelMemory (or a draft one)", None)
    devices: dict[str, DevicePlan] = {}
    pools: dict[str, PoolPlan] = {}
    tokens = max_seqs * (max_k + 1)
    for name, mem, side in sides:
        key = str(side.device)
        if key not in devices:
            devices[key] = DevicePlan(key, _budget(side, key, budget_fraction, budget_bytes))
        be, d = side.backend, devices[key]
        if mem.head_dim % be.spec.head_dim_align:
            raise HalError(f"{name} model head_dim: expected a multiple of {be.spec.head_dim_align} for backend "
                           f"{be.name}, got {mem.head_dim}; place the {name} on another backend")
        bs = block_size.get(name) or default_block_size(be)
        if bs not in be.spec.block_sizes:
            raise arg_error(f"block_size[{name!r}]", f"{be.spec.block_sizes} for backend {be.name}", bs)
        d.weights += mem.weight_bytes
        d.headroom = max(d.headroom, headroom_bytes(mem, tokens, tokens if name == "target" else max_seqs))
        pools[name] = PoolPlan(name, side, bs, 0, bs * mem.token_bytes(), mem)
    for d in devices.values():
        d.headroom += extra_headroom
        if d.weights + d.headroom > d.budget:
            raise HalError(f"memory plan on {d.device}: weights {d.weights / GiB:.3f} GiB + activation headroom "
                           f"{d.headroom / GiB:.3f} GiB exceed the budget {d.budget / GiB:.3f} GiB; raise the budget, "
                           "lower max_seqs or max_k, or move the draft to another device")
    # split each device's KV space between its pools in proportion to what one sequence needs
    need_blocks = {n: -(-(max_context + max_k + 1) // p.block_size) for n, p in pools.items()}
    capacity = {}
    for key, d in devices.items():
        here = [n for n, p in pools.items() if str(p.side.device) == key]
        per_seq = sum(need_blocks[n] * pools[n].block_bytes for n in here)
        seqs = (d.budget - d.weights - d.headroom) // per_seq
        for n in here:
            pools[n].num_blocks = seqs * need_blocks[n]
            d.kv += pools[n].num_blocks * pools[n].block_bytes
            capacity[n] = seqs
    fits = min(capacity.values())
    if fits < max_seqs:
        worst = min(capacity, key=capacity.get)
        d = devices[str(pools[worst].side.device)]
        per_token = sum(p.mem.token_bytes() for p in pools.values() if str(p.side.device) == d.device)
        ctx_fit = max(0, (d.budget - d.weights - d.headroom) // (max_seqs * per_token) - max_k - 1)
        raise HalError(f"memory plan on {d.device}: expected room for max_seqs={max_seqs} x max_context={max_context} "
                       f"({need_blocks[worst]} KV blocks of {pools[worst].block_size} tokens per {worst} sequence), "
                       f"got room for {fits} sequences; lower max_seqs to {fits}, or max_context to about {ctx_fit}, "
                       "or raise the budget")
    if not fill:
        for d in devices.values():
            d.kv = 0
        for n, p in pools.items():
            p.num_blocks = max_seqs * need_blocks[n]
            devices[str(p.side.device)].kv += p.num_blocks * p.block_bytes
    return Plan(devices, pools, max_seqs, max_context, capacity)


def _budget(side, key: str, fraction: float, explicit: dict[str, int]) -> int:
    if key in explicit:
        return int(explicit[key])
    mem = side.backend.spec.memory
    if mem is None:
        raise HalError(f"memory plan on {key}: expected a budget in bytes (budget_bytes={{{key!r}: ...}}), got none; "
                       f"backend {side.backend.name} cannot report device memory")
    _, total = mem(side.device.index or 0)
    return int(total * fraction)


def _weight_bytes(cfg) -> int:
    """fp32 bytes the runner holds for a `hal.models.llama.LlamaConfig`: embeddings, the [H, V]
    head copy, fused layer weights, norms."""
    nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layer = cfg.hidden * (nq + 2 * nk) + nq * cfg.hidden + 3 * cfg.hidden * cfg.ffn + 2 * cfg.hidden
    return 4 * (2 * cfg.vocab * cfg.hidden + cfg.layers * layer + cfg.hidden)
