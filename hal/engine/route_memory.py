"""What a router learned, kept for the next engine over the same machine, model and drafter.

A fresh engine (``spec-hal generate`` runs one per command; a server restarts) would
otherwise spend its first requests learning what the last one already knew: how often each
drafting method's drafts are accepted, and what scoring and drafting cost on this machine
beyond the profiled forward. `RouteMemory` keeps the router's overall rates (`Router.rates`:
the drafter's acceptance and offer rate, a lookup match's acceptance per match length) and its
measured step-cost ratios in one JSON
record under ``$HAL_CACHE/routing``, keyed as the linear plans are (`hal.models.plan_cache`:
the CPU signature) plus fingerprints of the target and the drafter (configs, weight shapes
and a sample of each weight's values). A router restores it when it is built and keeps it
as requests finish, at most once a second. ``HAL_ROUTE_MEMORY=0`` turns it off (each engine
learns afresh; the test suite runs so, for runs that do not depend on earlier ones); another
value names the folder to keep records in instead (benchmarks/routing.py starts from an empty one).

What it restores are the priors the router starts from: decayed counts that its own
measurements then outweigh, never a decision on this request's tokens. A record that is
absent, damaged, out of range or written for another key is ignored (the router learns
afresh); a cache that cannot be written is skipped. Output is unchanged either way: routing
decides only how many drafts are verified.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from pathlib import Path

import torch

from hal.models import plan_cache
from hal.models.cache_dir import cache_dir
from hal.models.machine import cpu_signature

KEEP_EVERY = 1.0                      # seconds between writes while requests finish


def fingerprint(obj, depth: int = 3) -> dict:
    """What identifies a model or drafter: its class and kind, its config, and its weights'
    names, shapes and first values, for it and the models it holds (``head``, ``model``, ``ngram``)."""
    out = {"class": type(obj).__name__, "kind": str(getattr(obj, "kind", "")),
           "lookup": list(getattr(obj, "lookup", None) or ())}
    cfg = getattr(obj, "cfg", None)
    if cfg is not None:
        out["cfg"] = repr(cfg)
    weights = getattr(obj, "w", None)
    if isinstance(weights, dict):
        h = hashlib.sha256()
        for name in sorted(weights):
            t = weights[name]
            h.update(f"{name}{tuple(getattr(t, 'shape', ()))}".encode())
            if isinstance(t, torch.Tensor) and t.numel():
                h.update(t.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
        out["weights"] = h.hexdigest()[:16]
    if depth:
        for name in ("head", "model", "ngram"):
            inner = getattr(obj, name, None)
            if inner is not None and inner is not obj:
                out[name] = fingerprint(inner, depth - 1)
    return out


class RouteMemory:
    """One router's record on disk (``path``; None: nothing is kept) for ``key``."""

    def __init__(self, path: Path | None, key: dict):
        self.path, self.key, self.kept_at = path, key, -math.inf
        self._writer: threading.Thread | None = None

    @classmethod
    def for_engine(cls, target, drafter) -> RouteMemory:
        """The record of this machine, ``target`` and ``drafter``."""
        key = json.loads(json.dumps({"signature": cpu_signature(device=getattr(target, "device", None)),
                                     "target": fingerprint(target), "drafter": fingerprint(drafter)}))
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        where = os.environ.get("HAL_ROUTE_MEMORY", "")
        folder = None if where == "0" else Path(where) if where else cache_dir() / "routing"
        return cls(None if folder is None else folder / f"router-{digest}.json", key)

    def restore(self, router) -> bool:
        """Start ``router`` from the record, if there is a valid one for this key."""
        saved = plan_cache.load(self.path, self.key, "routing") if self.path is not None else None
        state = _valid(saved)
        if state is None:
            return False
        for name, ewma in router.rates().items():   # at most the weight its own decayed counts can reach
            if name not in state["rates"]:
                continue
            accepted, trials = state["rates"][name]
            scale = min(1.0, (router.max_k + 1) / (1.0 - ewma.decay) / trials) if trials > 0 else 1.0
            ewma.accepted, ewma.trials = accepted * scale, trials * scale
        pad = 4 - len(state["ratio"])   # a record from before lookup steps were measured apart (stop 79)
        router.ratio = list(state["ratio"]) + [0.0] * pad
        # counts cut to 8: a mean no more, new steps weigh in
        router.ratio_steps = [min(8, n) for n in state["ratio_steps"]] + [0] * pad
        return True

    def keep(self, router) -> None:
        """Write the router's rates (at most every `KEEP_EVERY` seconds), on a thread of its own:
        the file system's time (0.3-2 ms here) is not the engine step's. `flush` waits for it."""
        t = time.monotonic()
        if self.path is None or t - self.kept_at < KEEP_EVERY:
            return
        self.kept_at = t
        record = {"signature": self.key, "dtype": "routing",
                  "rates": {name: [e.accepted, e.trials] for name, e in router.rates().items()},
                  "ratio": list(router.ratio), "ratio_steps": list(router.ratio_steps)}
        self.flush()   # one write at a time, in order
        self._writer = threading.Thread(target=self._write, args=(record,), name="route-memory")
        self._writer.start()   # not a daemon: an exiting process still writes what it learned

    def flush(self) -> None:
        """Wait for the last `keep`'s write."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write(self, record: dict) -> None:
        try:
            plan_cache.store(self.path, record)
        except OSError:   # a read-only cache: the next engine learns afresh
            pass


def _valid(saved) -> dict | None:
    """``saved`` when every field is a number in range (JSON numbers only: a file is untrusted), else None."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    try:
        rates, ratio, steps = saved["rates"], saved["ratio"], saved["ratio_steps"]
        if not (isinstance(rates, dict) and isinstance(ratio, list) and isinstance(steps, list)):
            return None
        for pair in rates.values():
            if not (isinstance(pair, list) and len(pair) == 2 and all(map(number, pair))
                    and 0 <= pair[0] <= pair[1] + 1e-9):
                return None
        if len(ratio) not in (3, 4) or len(steps) != len(ratio) or not all(number(r) and 0 <= r < 1e3 for r in ratio):
            return None
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in steps):
            return None
    except (TypeError, KeyError):
        return None
    return saved
