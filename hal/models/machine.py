"""What a measured plan depends on, and what every benchmark names: the CPU model, its SIMD
flags (avx*, amx*), cores, threads and the torch version."""

from __future__ import annotations

import os

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")   # a bfloat16 unit: bfloat16 float candidates under auto


def cpu_flags() -> list[str]:
    """The SIMD flags that decide a layout's speed (avx*, amx*), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return sorted(f for f in flags if f.startswith(("avx", "amx")))


def cpu_signature(threads: int | None = None, device: torch.device | None = None) -> dict:
    """What a measured plan depends on: CPU model, SIMD flags, cores, threads, torch version
    (and the device, when it is not the CPU)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    sig = {"cpu": model or "unknown", "flags": cpu_flags(), "cores": os.cpu_count() or 1,
           "threads": threads or torch.get_num_threads(), "torch": torch.__version__}
    if device is not None and torch.device(device).type != "cpu":
        sig["device"] = torch.device(device).type
    return sig


def machine_line(plan=None, threads: int | None = None) -> str:
    """One line for a benchmark's results: the CPU, its SIMD flags and (given) the linear plan."""
    sig = cpu_signature(threads)
    line = (f"CPU {sig['cpu']} ({sig['cores']} cores, {sig['threads']} threads; flags "
            f"{' '.join(sig['flags']) or 'none'}), torch {sig['torch']}")
    return line + (f"; linear plan {plan.describe()}" if plan is not None else "")
