"""Linear layouts measured on the machine that runs them: how the batch-invariant runner
computes ``x @ W.T``.

A `LinearPlan` is a layout (``mm``: ``mm(W, X.T).T``; ``linear``: ``F.linear(X, W)``), a
dtype for the weights and the multiplied rows (float32, or bfloat16 where the CPU has
AVX512-BF16 or AMX), and the chunk widths: every row is computed inside a chunk of exactly
one of those widths (zero-padded), so its bits never depend on how many rows came with it.

`choose_plan` picks one at model load:

1. **Usable** candidates only. For each layout and dtype, each probe width is run with a row
   in several positions among random batch-mates, on every weight shape of the model; a width
   whose row changes with its mates or position is dropped, and the remaining widths are
   grouped by the bits they give (widths in one group agree with each other exactly). Each
   group is a candidate plan.
2. The **fastest** usable candidate by the measured time of all the model's linears at a mix
   of rows (`MIX`: one-token decode, a 4-draft verify, an 8-node tree verify).
3. **Cached** per CPU signature (model name, SIMD flags, cores, threads, torch version) and
   weight shapes under ``$HAL_CACHE/plans``, so a second load costs nothing; a cache written
   under another signature is ignored. ``refresh=True`` (``--plan-refresh``) re-measures.

Nothing here is tuned for one microarchitecture: the AVX2 machine this runner was first
written on chose ``mm`` in 4/8-row chunks; an AMX machine measured bf16 ``mm`` flat from 2 to 16
rows; each machine now finds its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.models.cache_dir import cache_dir
from hal.errors import HalError
from hal.models.progress import bar as progress_bar

Layout = Callable[[Tensor, Tensor], Tensor]   # (x [M, K], w [N, K]) -> x @ w.T [M, N]
LAYOUTS: dict[str, Layout] = {
    "mm": lambda x, w: torch.mm(w, x.T).T,
    "linear": lambda x, w: F.linear(x, w),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROBE_WIDTHS = (1, 2, 4, 8, 16)
MIX = {1: 0.5, 5: 0.25, 9: 0.25}       # rows per forward -> weight in the score (decode, verify k=4, tree of 8)
REPORT_ROWS = (1, 5, 9, 16)
NOISE = 0.25   # the winner timed twice: scores further apart than this (relative) make the measurement noisy
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class LinearPlan:
    """How ``x @ W.T`` is computed: ``LAYOUTS[layout]`` on ``dtype`` operands, each row in a
    chunk of exactly one of ``widths`` (ascending)."""

    layout: str
    dtype: torch.dtype
    widths: tuple[int, ...]
    fn: Layout | None = field(default=None, compare=False, repr=False)   # a layout not in LAYOUTS (tests)

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """``x @ w.T`` for ``x`` [T, K] (any float dtype), computed in ``w``'s dtype (the model
        casts its weights to ``self.dtype`` once), returned as float32."""
        fn, T = self.fn or LAYOUTS[self.layout], x.shape[0]
        x = x.to(w.dtype)
        out = torch.empty(T, w.shape[0], dtype=torch.float32, device=x.device)
        start = 0
        while start < T:
            left = T - start
            width = next((n for n in self.widths if n >= left), self.widths[-1])
            end = min(start + width, T)
            chunk = x[start:end]
            if end - start < width:
                chunk = torch.cat([chunk, chunk.new_zeros(width - (end - start), x.shape[1])])
            out[start:end] = fn(chunk.contiguous(), w)[:end - start]
            start = end
        return out

    def describe(self) -> str:
        name = "mm(W, X.T)" if self.layout == "mm" else "F.linear"
        return f"{str(self.dtype).removeprefix('torch.')} {name} in chunks of {'/'.join(map(str, self.widths))}"

    def to_json(self) -> dict:
        return {"layout": self.layout, "dtype": str(self.dtype).removeprefix("torch."), "widths": list(self.widths)}

    @classmethod
    def from_json(cls, d: dict) -> "LinearPlan":
        if d.get("layout") not in LAYOUTS or d.get("dtype") not in DTYPES:
            raise HalError(f"linear plan: expected a layout in {sorted(LAYOUTS)} and a dtype in {sorted(DTYPES)}, "
                           f"got {d!r:.120}")
        return cls(d["layout"], DTYPES[d["dtype"]], tuple(int(n) for n in d["widths"]))


@dataclass
class Choice:
    """The chosen plan and what it was chosen from."""

    plan: LinearPlan
    signature: dict
    candidates: list[dict] = field(default_factory=list)   # {"plan", "ms" by rows, "score"} per usable candidate
    rejected: list[str] = field(default_factory=list)       # layouts/widths dropped by the self-check, and why
    from_cache: bool = False
    measured: dict = field(default_factory=dict)   # {"at": UTC time, "load": 1-min load average, "spread": ...}

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


def cpu_flags() -> list[str]:
    """The SIMD flags that decide a layout's speed (avx*, amx*), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return sorted(f for f in flags if f.startswith(("avx", "amx")))


def cpu_signature(threads: int | None = None, device: torch.device | None = None) -> dict:
    """What a measured plan depends on: CPU model, SIMD flags, cores, threads, torch version
    (and the device, when it is not the CPU)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    sig = {"cpu": model or "unknown", "flags": cpu_flags(), "cores": os.cpu_count() or 1,
           "threads": threads or torch.get_num_threads(), "torch": torch.__version__}
    if device is not None and torch.device(device).type != "cpu":
        sig["device"] = torch.device(device).type
    return sig


def candidate_dtypes(dtype: str, flags: list[str]) -> list[torch.dtype]:
    """The dtypes ``--dtype`` allows here: auto is float32, plus bfloat16 where the CPU has a bf16 unit."""
    if dtype not in ("auto", *DTYPES):
        raise HalError(f"dtype: expected auto, float32 or bfloat16, got {dtype!r}", arg="dtype")
    if dtype != "auto":
        return [DTYPES[dtype]]
    return [torch.float32] + ([torch.bfloat16] if any(f in flags for f in BF16_FLAGS) else [])


def offered_dtypes() -> list[str]:
    """The dtype names ``--dtype auto`` chooses among on this CPU: float32, plus bfloat16 where it has a bf16 unit."""
    return [str(d).removeprefix("torch.") for d in candidate_dtypes("auto", cpu_flags())]


def usable_groups(fn: Layout, dtype: torch.dtype, shapes: list[tuple[int, int]], widths=PROBE_WIDTHS,
                  seed: int = 0, device: torch.device | None = None,
                  rows: int = 64) -> tuple[list[tuple[int, ...]], list[str]]:
    """Width groups whose rows are independent of their batch-mates and position and agree
    bit for bit within the group, on every shape ``[N, K]`` (on ``device``); and why the
    other widths fail.

    ``rows`` random rows are computed in chunks of each width twice, in two random orders (so
    each row meets other mates at another position): a width whose rows change is dropped.
    Widths are grouped by the bits of all those rows; many rows are needed because two
    accumulation orders rounded to bfloat16 agree on most values and differ on a few."""
    g = torch.Generator().manual_seed(seed)
    dev = device or torch.device("cpu")
    bits: dict[int, list[bytes]] = {n: [] for n in widths}
    why = []
    for N, K in shapes:
        w = torch.randn(N, K, generator=g).to(dev, dtype)
        x = torch.randn(rows, K, generator=g).to(dev, dtype)
        orders = [torch.randperm(rows, generator=g) for _ in range(2)]
        for n in list(bits):
            runs = []
            for order in orders:
                out = torch.empty(rows, N, dtype=torch.float32, device=dev)
                for start in range(0, rows, n):
                    idx = order[start:start + n]
                    chunk = x[idx.to(dev)]
                    if len(idx) < n:   # the last chunk: random mates as padding
                        chunk = torch.cat([chunk, torch.randn(n - len(idx), K, generator=g).to(dev, dtype)])
                    out[idx.to(dev)] = fn(chunk.contiguous(), w)[:len(idx)].float()
                runs.append(out.cpu().numpy().tobytes())
            if runs[0] != runs[1]:
                why.append(f"width {n} on [{N}, {K}]: a row's bits depend on its batch-mates or position")
                del bits[n]
                continue
            bits[n].append(runs[0])
    groups: dict[tuple, list[int]] = {}
    for n, sig in bits.items():
        groups.setdefault(tuple(sig), []).append(n)
    return [tuple(ws) for ws in groups.values()], why


def time_plan(plan: LinearPlan, weights: list[Tensor], rows=REPORT_ROWS, reps: int = 5) -> dict[int, float]:
    """Median ms of all of ``weights``' products (already in the plan's dtype, on their device)
    at each row count."""
    dev = weights[0].device
    xs = {K: torch.randn(max(rows), K, device=dev) for K in {w.shape[1] for w in weights}}
    sync = getattr(getattr(torch, dev.type, None), "synchronize", lambda: None) if dev.type != "cpu" else lambda: None
    out = {}
    for m in rows:
        def once():
            for w in weights:
                plan.linear(xs[w.shape[1]][:m], w)
            sync()
        once()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        out[m] = round(statistics.median(times) * 1e3, 3)
    return out


def score(ms: dict[int, float]) -> float:
    return sum(weight * ms[m] for m, weight in MIX.items())


def _cache_path(signature: dict, shapes, dtype: str, layouts) -> Path:
    key = json.dumps([signature, sorted(set(shapes)), dtype, sorted(layouts)], sort_keys=True)
    return cache_dir() / "plans" / f"linear-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def choose_plan(shapes: list[tuple[int, int]], dtype: str = "auto", *, weights: list[Tensor] | None = None,
                refresh: bool = False, threads: int | None = None, layouts: dict[str, Layout] | None = None,
                reps: int = 3, cache: bool = True, device: torch.device | str | None = None,
                progress: bool = False) -> Choice:
    """The fastest usable `LinearPlan` for a model whose linear weights have ``shapes`` ([N, K]
    each, in forward order) on this machine; see the module docstring. ``weights``: those
    weights to time with (default: random ones of the shapes, made only when measuring).
    ``layouts``: the candidates (default `LAYOUTS`; tests plant others). `HalError` when no
    candidate of the requested dtype is usable. ``progress``: a bar (tqdm, stderr) while measuring."""
    layouts = LAYOUTS if layouts is None else layouts
    dev = torch.device(device) if device is not None else torch.device("cpu")
    signature = cpu_signature(threads, dev)
    shapes = [tuple(int(n) for n in s) for s in shapes]
    path = _cache_path(signature, shapes, dtype, layouts) if cache and layouts is LAYOUTS else None
    if path is not None and path.exists() and not refresh:
        try:
            saved = json.loads(path.read_text())
            if saved.get("signature") == signature and saved.get("dtype") == dtype:
                return Choice(LinearPlan.from_json(saved["plan"]), signature, saved.get("candidates", []),
                              saved.get("rejected", []), from_cache=True, measured=saved.get("measured") or {})
        except (ValueError, KeyError, HalError):
            pass   # a damaged or foreign cache file: measure again
    if weights is None:
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    for _ in range(2):   # a noisy measurement is repeated once; still noisy, it is not cached
        choice = _measure(shapes, dtype, weights, signature, layouts, reps, dev, progress)
        if not choice.noisy:
            break
    if path is not None and not choice.noisy:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"signature": signature, "dtype": dtype, "plan": choice.plan.to_json(),
                                   "candidates": choice.candidates, "rejected": choice.rejected,
                                   "measured": choice.measured}, indent=1))
        tmp.replace(path)
    return choice


def _measure(shapes, dtype: str, weights: list[Tensor], signature: dict, layouts, reps: int, dev,
             progress: bool) -> Choice:
    """Time every usable candidate, then the winner once more: the spread of its two scores
    (relative to the lower) says whether the machine was quiet enough to trust the choice."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    candidates, rejected, casts = [], [], {}
    flags = signature["flags"] if dev.type == "cpu" else list(BF16_FLAGS)   # accelerators: measure bf16 too
    bar = progress_bar(progress, len(candidate_dtypes(dtype, flags)) * len(layouts), "linear plan", "layout")
    for dt in candidate_dtypes(dtype, flags):
        casts[dt] = cast = [w.to(dev, dt) for w in weights]
        for name, fn in layouts.items():
            groups, why = usable_groups(fn, dt, sorted(set(shapes)), device=dev)
            rejected += [f"{str(dt).removeprefix('torch.')} {name}: {w}" for w in why]
            for widths in groups:
                plan = LinearPlan(name, dt, widths, None if LAYOUTS.get(name) is fn else fn)
                ms = time_plan(plan, cast, reps=reps)
                candidates.append({"plan": plan, "ms": ms, "score": round(score(ms), 3)})
            bar.update()
    bar.close()
    if not candidates:
        raise HalError(f"dtype {dtype}: expected a batch-invariant linear layout on this CPU, got none usable "
                       f"({'; '.join(rejected[:4])})", arg="dtype")
    best = min(candidates, key=lambda c: c["score"])
    again = score(time_plan(best["plan"], casts[best["plan"].dtype], reps=reps))
    spread = abs(again - best["score"]) / max(min(again, best["score"]), 1e-9)
    measured = {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": round(load, 2),
                "spread": round(spread, 3)}
    table = [{**c, "plan": c["plan"].to_json()} for c in candidates]
    return Choice(best["plan"], signature, table, rejected, measured=measured)


def machine_line(plan: LinearPlan | None = None, threads: int | None = None) -> str:
    """One line for a benchmark's results: the CPU, its SIMD flags and (given) the linear plan."""
    sig = cpu_signature(threads)
    line = (f"CPU {sig['cpu']} ({sig['cores']} cores, {sig['threads']} threads; flags "
            f"{' '.join(sig['flags']) or 'none'}), torch {sig['torch']}")
    return line + (f"; linear plan {plan.describe()}" if plan is not None else "")
