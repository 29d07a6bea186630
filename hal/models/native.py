"""Compiling the runner's native code for this CPU, once: a shared library under
``$HAL_CACHE/kernels``, named by a hash of its sources, the flags, the compiler's version and
the CPU signature, so a cached build is never one made for other code or another CPU."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

from hal.errors import HalError
from hal.models.cache_dir import cache_dir
from hal.models.machine import cpu_signature


def compile_library(what: str, sources: list[Path], compiler: str | None, flags: tuple[str, ...],
                    libs: tuple[str, ...] = ()) -> Path:
    """The library built from ``sources`` (the first is compiled; the others are what it
    includes, hashed), compiled when not cached. HalError naming ``what`` when there is no
    compiler or it fails."""
    if not compiler:
        raise HalError(f"{what}: expected a compiler on PATH (or named by $CC / $CXX), got none")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise HalError(f"{what}: expected a working compiler at {compiler}, got {e}") from None
    sig = cpu_signature()
    text = [p.read_bytes() for p in sources]
    key = hashlib.sha256(repr((text, flags, libs, version, sig["cpu"], sig["flags"])).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{sources[0].stem}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        try:
            r = subprocess.run([compiler, *flags, "-o", str(out), str(sources[0]), *libs], capture_output=True,
                               text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise HalError(f"{what}: expected {compiler} to compile {sources[0].name}, got {e}") from None
        if r.returncode != 0:
            raise HalError(f"{what}: expected {compiler} to compile {sources[0].name}, got exit {r.returncode}: "
                           f"{(r.stderr or r.stdout).strip()[-400:]}")
        os.replace(out, path)   # atomic: a process beside this one loads a whole file or builds its own
    return path


def torch_flags(base: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Compiler flags (``base`` first) and libraries for C++ built against the installed torch
    with its OpenMP: ``-fopenmp`` links ``libgomp.so.1``, and the rpath finds the wheel's copy
    first (the one torch loaded), so at::parallel_for runs on torch's own threads."""
    import torch
    from torch.utils import cpp_extension
    lib = str(Path(torch.__file__).parent / "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    flags = (*base, "-std=gnu++17", abi, f"-DHAL_TORCH={torch.__version__}", "-w", "-fopenmp",
             f"-I{Path(__file__).parent}", *(f"-I{p}" for p in cpp_extension.include_paths()))
    return flags, (f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}")
