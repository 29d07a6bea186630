"""Where measured linear plans are kept (`hal.models.linear_plan`): one JSON record per CPU
signature, weight shapes, dtype, layouts, int4 storage and candidate families under
``$HAL_CACHE/plans``, written atomically, and a lock beside each so one process measures a
plan at a time."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path

from hal.models.cache_dir import cache_dir


def path(signature: dict, shapes, dtype: str, layouts, int4_shapes, families=()) -> Path:
    """The record's file for this key (``families``: the candidate families measured, so a
    version that measures others never reads this one's choice)."""
    key = json.dumps([signature, sorted(set(shapes)), dtype, sorted(layouts), sorted(int4_shapes), sorted(families)],
                     sort_keys=True)
    return cache_dir() / "plans" / f"linear-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def load(at: Path, signature: dict, dtype: str) -> dict | None:
    """The record at ``at`` when it was written for this signature and dtype; None when it is
    absent, damaged or foreign (the caller measures again)."""
    if not at.exists():
        return None
    try:
        saved = json.loads(at.read_text())
    except ValueError:
        return None
    ok = isinstance(saved, dict) and saved.get("signature") == signature and saved.get("dtype") == dtype
    return saved if ok else None


def store(at: Path, record: dict) -> None:
    """Write ``record`` at ``at`` atomically (a reader never sees half of it)."""
    at.parent.mkdir(parents=True, exist_ok=True)
    tmp = at.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(at)


@contextlib.contextmanager
def measuring(at: Path | None):
    """Hold ``at``'s lock file while measuring: two processes loading one model (a target and
    a draft rank) would otherwise time each other's contention, and cache it."""
    if at is None:
        yield
        return
    at.parent.mkdir(parents=True, exist_ok=True)
    with open(at.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, or the holder dies
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
