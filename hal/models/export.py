"""``spec-hal model export-drafter``: a drafter shipped in the package written whole, in the
layout its authors publish, for vLLM, SGLang or the authors' own code."""

from __future__ import annotations

from pathlib import Path

from hal.errors import HalError


def export_drafter(kind: str, model: str, out: str | Path, backend) -> Path:
    """``out``: the drafter of ``kind`` (eagle, dspark) shipped for ``model``, whole, in its
    published layout: the EAGLE-3 head as shipped (SafeAILab's), the DSpark drafter with copies of
    the target's embeddings and lm_head (DeepSpec's ``Qwen3DSparkModel``; the package ships it
    without them, and `hal.models.block_layouts.load_block` borrows the target's)."""
    import shutil

    from hal.models.dspark import shipped_block
    from hal.models.eagle import shipped_head
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HalError(f"--out: expected a new or empty folder, got {str(out)!r} with files in it", arg="--out")
    try:
        src = (shipped_head if kind == "eagle" else shipped_block)(model)
    except HalError as e:
        raise HalError(f"--model: expected a model with a shipped {kind} drafter, got {model!r} ({e})",
                       arg="--model") from None
    if kind == "eagle":
        out.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(src / name, out / name)
        return out
    from hal.models.block_layouts import with_copies
    from hal.models.fetch import load_model
    target, _ = load_model(model, backend)
    with_copies(src, out, target)
    return out
