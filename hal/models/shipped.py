"""Drafters shipped in the package (`hal/models/heads/<folder>/`): which folder serves a model,
its weights' sha256 checked on every lookup."""

from __future__ import annotations

from pathlib import Path

from hal.errors import HalError

HEADS_DIR = Path(__file__).parent / "heads"


def shipped_folder(table: dict[str, tuple[str, str]], model: str, kind: str, what: str) -> Path:
    """The folder ``table`` (model name -> (folder, sha256 of its model.safetensors)) ships for
    ``model`` (a `hal.models.fetch.MODELS` name or its GGUF path). `HalError` naming ``--draft``
    (``kind``: its value, ``what``: the drafter's name in messages) when there is none, or when
    the weights are not the ones shipped."""
    from hal.models.fetch import MODELS, _sha256
    name = next((n for n in table if model == n or Path(model).name == Path(MODELS[n]["member"]).name), None)
    if name is None:
        raise HalError(f"--draft {kind}: expected a model with a shipped {what} ({sorted(table)}) or {kind}:<folder>, "
                       f"got {model!r}", arg="--draft")
    folder, sha = table[name]
    path = HEADS_DIR / folder
    got = _sha256(path / "model.safetensors") if (path / "model.safetensors").is_file() else "no file"
    if got != sha:
        raise HalError(f"{what} {folder}: expected model.safetensors with sha256 {sha}, got {got}")
    return path

