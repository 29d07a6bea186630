"""Where spec-hal keeps what it fetches or measures: ``$HAL_CACHE`` (default ``~/.cache/spec-hal``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HAL_CACHE", Path.home() / ".cache" / "spec-hal"))
