"""A compiler that always fails, for the native code's fallback tests."""

from __future__ import annotations


def plant_failing_compiler(monkeypatch, tmp_path, env: str, module) -> None:
    """``$env`` names a compiler that prints "planted failure" and exits 1; ``$HAL_CACHE`` is a
    fresh folder (nothing cached) and ``module``'s loaded library is forgotten."""
    fake = tmp_path / env.lower()
    fake.write_text(f"#!/bin/sh\necho '{env}: planted failure' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(env, str(fake))
    monkeypatch.setattr(module, "_loaded", {})
