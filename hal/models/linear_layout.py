"""A linear plan as data: the layout, dtype, chunk widths and weight forms a
`hal.models.linear_plan` measurement chose, and how it multiplies (`LinearPlan.linear`: each
row in a chunk of exactly one of the widths, zero-padded, so its bits never depend on how many
rows came with it). Its JSON form is what the plan cache holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError
from hal.models import int4, k_quants, plan_check, q4_rows


LAYOUTS: dict[str, plan_check.Layout] = {
    "mm": lambda x, w: torch.mm(w, x.T).T,
    "linear": lambda x, w: F.linear(x, w),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHTS = ("float", "int4", "q4q8")     # how the weights stored as int4 blocks run (`LinearPlan.weights`)
STORED = ("int4", "q4q8")                # the forms that run them as stored
STORED_TYPES = (int4.Int4Weight, q4_rows.Q4Weight, k_quants.MixedWeight)   # a weight packed in one of those forms


def form_of(w) -> str | None:
    """The `STORED` form a packed weight runs in (None: a float tensor)."""
    return "q4q8" if isinstance(w, (q4_rows.Q4Weight, k_quants.MixedWeight)) else \
        "int4" if isinstance(w, int4.Int4Weight) else None
def coded(w, codes: int):
    """A q4q8 weight multiplying rows of ``codes`` int8 codes per input (its tiles shared); else ``w``."""
    return w.with_codes(codes) if form_of(w) == "q4q8" and w.codes != codes else w


HEADS = ("float", "q8_0", "q6_k")        # how an lm_head stored as Q8_0 / Q6_K runs (`LinearPlan.head`)


@dataclass(frozen=True)
class LinearPlan:
    """How ``x @ W.T`` is computed: ``LAYOUTS[layout]`` on ``dtype`` operands, each row in a
    chunk of exactly one of ``widths`` (ascending)."""

    layout: str
    dtype: torch.dtype
    widths: tuple[int, ...]
    fn: plan_check.Layout | None = field(default=None, compare=False, repr=False)   # a layout not in LAYOUTS (tests)
    weights: str = "float"   # int4: weights stored as int4 blocks run as stored (`hal.models.int4`), rows in dtype;
    #                          q4q8: the same blocks times rows quantized per 32 to int8 (`hal.models.q4_rows`), each
    #                          product in one call (its rows are independent by construction: no chunks)
    head: str = "float"      # q8_0 / q6_k: the lm_head's codes as stored (int4: two int4 halves; q4q8: Q8 / Q6 tiles)
    costs: tuple[float, ...] = field(default=(), compare=False)   # ms of one chunk of each width (measured):
    #                                                               rows then go in the cheapest chunks (`chunks`)
    codes: int = 2           # q4q8: int8 codes per input of a quantized row (`hal.models.q4_rows.Q4Weight.codes`):
    #                          2 (value and residual, ~15 bits) or 1 (llama.cpp's int8 rows); a loader's choice
    #                          for its file (`hal.models.loaders.load_gguf`), not measured nor cached

    def __post_init__(self):
        if self.costs and len(self.costs) != len(self.widths):
            raise HalError(f"costs: expected none or one per width {self.widths}, got {self.costs}", arg="costs")
        if self.codes not in q4_rows.CODES:
            raise HalError(f"codes: expected int8 codes per input in {q4_rows.CODES}, got {self.codes!r}", arg="codes")

    def linear(self, x: Tensor, w: Tensor | int4.Int4Weight, out_dtype: torch.dtype = torch.float32) -> Tensor:
        """``x @ w.T`` for ``x`` [T, K] (any float dtype), computed in ``w``'s dtype (the model
        casts its weights to ``self.dtype`` once; an `hal.models.int4.Int4Weight` multiplies
        rows of its activation dtype; a `hal.models.q4_rows.Q4Weight` all rows in one call),
        returned as ``out_dtype`` (``w.dtype``: the product as computed, with no conversion)."""
        if isinstance(w, (q4_rows.Q4Weight, k_quants.MixedWeight)):
            got = plan_check.int4_mm(x, w)
            return got if got.dtype == out_dtype else got.to(out_dtype)
        fn = plan_check.int4_mm if isinstance(w, int4.Int4Weight) else self.fn or LAYOUTS[self.layout]
        T = x.shape[0]
        if x.dtype != w.dtype:
            x = x.to(w.dtype)
        parts = chunks(self.widths, T, self.costs)
        if parts == [T]:   # one chunk, no padding: the same product, without the output buffer's copy
            got = fn(x.contiguous(), w)
            if got.is_contiguous():
                return got if got.dtype == out_dtype else got.to(out_dtype)
            return torch.empty(T, w.shape[0], dtype=out_dtype, device=x.device).copy_(got)
        out = torch.empty(T, w.shape[0], dtype=out_dtype, device=x.device)
        start = 0
        for width in parts:
            end = min(start + width, T)
            chunk = x[start:end]
            if end - start < width:
                chunk = torch.cat([chunk, chunk.new_zeros(width - (end - start), x.shape[1])])
            out[start:end] = fn(chunk.contiguous(), w)[:end - start]
            start = end
        return out

    def describe(self) -> str:
        name = "mm(W, X.T)" if self.layout == "mm" else "F.linear"
        dt, widths = str(self.dtype).removeprefix("torch."), "/".join(map(str, self.widths))
        head = f"; lm_head {self.head.upper()} as stored" if self.head != "float" else ""
        if self.weights == "q4q8":
            return (f"Q4_0/Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K weights as stored times {dt} rows quantized per 32 "
                    f"to {q4_rows.ROW_WORDS[self.codes]} (q4q8{head}; other weights {dt} {name} in chunks of {widths})")
        if self.weights == "int4":
            return f"int4 weights as stored ({dt} rows{head}; other weights {dt} {name}) in chunks of {widths}"
        return f"{dt} {name} in chunks of {widths}"

    def to_json(self) -> dict:
        return {"layout": self.layout, "dtype": str(self.dtype).removeprefix("torch."), "widths": list(self.widths),
                "weights": self.weights, "head": self.head, "costs": list(self.costs)}

    @classmethod
    def from_json(cls, d: dict) -> "LinearPlan":
        weights, head, costs = d.get("weights", "float"), d.get("head", "float"), d.get("costs", [])
        if d.get("layout") not in LAYOUTS or d.get("dtype") not in DTYPES or weights not in WEIGHTS \
                or head not in HEADS or (head != "float" and weights not in STORED) \
                or (head == "q6_k" and weights != "q4q8") or not _costs_fit(costs, d):
            raise HalError(f"linear plan: expected a layout in {sorted(LAYOUTS)}, a dtype in {sorted(DTYPES)}, "
                           f"weights in {list(WEIGHTS)}, a head in {list(HEADS)} (q8_0 only with "
                           f"{' or '.join(STORED)}, q6_k with q4q8) and "
                           f"costs none or one positive number per width, got {d!r:.160}")
        return cls(d["layout"], DTYPES[d["dtype"]], tuple(int(n) for n in d["widths"]), weights=weights, head=head,
                   costs=tuple(float(c) for c in costs))



def chunks(widths: tuple[int, ...], rows: int, costs: tuple[float, ...] = ()) -> list[int]:
    """The chunk widths ``rows`` rows are computed in (`LinearPlan.linear`). With ``costs`` (ms
    of one chunk of each width, measured): the cheapest set of chunks that holds them (widths of
    one plan give a row the same bits, so any set is as exact); else the narrowest width that
    holds what is left, then again, the widest while none does."""
    if costs:
        return list(_cheapest(tuple(widths), tuple(costs), rows))
    out = []
    while rows > 0:
        width = next((n for n in widths if n >= rows), widths[-1])
        out.append(width)
        rows -= width
    return out


@lru_cache(maxsize=4096)
def _cheapest(widths: tuple[int, ...], costs: tuple[float, ...], rows: int) -> tuple[int, ...]:
    """The least total cost of chunks holding ``rows`` rows (padding allowed), widest first; on
    a tie, the fewer chunks (so one chunk of exactly ``rows`` when it costs no more)."""
    best, last = [(0.0, 0)], [0]   # per row count: (cost, chunks) of its cheapest set, and that set's last width
    for r in range(1, rows + 1):
        key, width = min(((best[max(r - n, 0)][0] + c, best[max(r - n, 0)][1] + 1), n) for n, c in zip(widths, costs))
        best.append(key)
        last.append(width)
    out, r = [], rows
    while r > 0:
        out.append(last[r])
        r = max(r - last[r], 0)
    return tuple(sorted(out, reverse=True))


def _costs_fit(costs, d: dict) -> bool:
    """``costs`` from a cached plan: none, or one positive number per width."""
    return isinstance(costs, list) and (not costs or (
        len(costs) == len(d.get("widths", [])) and all(isinstance(c, (int, float)) and not isinstance(c, bool)
                                                      and 0 < c < float("inf") for c in costs)))


NOISE = 0.25   # the winner timed twice: scores further apart than this (relative) make the measurement noisy


@dataclass
class Choice:
    """The chosen plan and what it was chosen from."""

    plan: LinearPlan
    signature: dict
    candidates: list[dict] = field(default_factory=list)   # {"plan", "ms" by rows, "score"} per usable candidate
    rejected: list[str] = field(default_factory=list)       # layouts/widths dropped by the self-check, and why
    from_cache: bool = False
    measured: dict = field(default_factory=dict)   # {"at": UTC time, "load": 1-min load average, "spread": ...}
    heads: list[dict] = field(default_factory=list)   # {"head", "ms" by rows, "score"} per lm_head form timed

    @property
    def noisy(self) -> bool:
        return self.measured.get("spread", 0.0) > NOISE

    def conditions(self) -> str:
        """When and under what load the plan was measured, and its timing spread."""
        m = self.measured
        if not m:
            return "measured before spread was recorded"
        said = f"measured {m['at']} at load {m['load']:.2f}, spread {m['spread']:.0%}"
        return said + (f" (noisy: over {NOISE:.0%}; not cached, measured again next time)" if self.noisy else "")

    def summary(self) -> str:
        source = "cached" if self.from_cache else "measured"
        return (f"{self.plan.describe()} ({source} for {self.signature['cpu']}, {self.signature['threads']} "
                f"threads; flags {' '.join(self.signature['flags']) or 'none'}; {self.conditions()})")
