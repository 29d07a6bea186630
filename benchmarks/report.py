"""Shared by the benchmarks: print a results table and write it under benchmarks/results/."""

from __future__ import annotations

from pathlib import Path


def publish(lines: list[str], out: str | Path) -> str:
    """Join ``lines``, print them, and write them to ``out`` (its folder made if needed)."""
    text = "\n".join(lines) + "\n"
    print(text)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    return text
