"""The cuda backend: every op as a Triton kernel.

Available on a real CUDA device, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, which must be set before the kernels are imported).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from hal import BackendSpec, BlockSizes, hookimpl

GPU_VALIDATION = ("run on an H200 (Triton 3.6) on 2026-12-04: conformance 459 of 461 and the long tail passed; "
                  "the 2 failures (the tree kernel failing to compile at narrow tiles) were fixed after, "
                  "checked by compiling every kernel for sm_90 under Triton 3.6 on CPU, not rerun on a GPU")


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _probe() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'spec-hal[triton]')"
    if interpreted():
        return None
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU under the Triton interpreter)"
    return None


def _synchronize() -> None:
    import torch
    torch.cuda.synchronize()


def _memory(index: int) -> tuple[int, int]:
    import torch
    return torch.cuda.mem_get_info(index)


INTERPRETED_FUZZ = 20   # fuzz examples per property under the interpreter by default (--slow: all)
INTERPRETED_DRAWS = 0.25   # the share of test_sample's draws under the interpreter by default (--slow: all)


@hookimpl
def register_backends(register):
    interp = interpreted()
    register(BackendSpec(
        name="cuda",
        device_type="cpu" if interp else "cuda",
        load=lambda: importlib.import_module("backends.cuda.ops"),
        probe=_probe,
        priority=-10 if interp else 20,  # auto never prefers the (slow) interpreter over cpu
        block_sizes=BlockSizes(lo=16, hi=128, power_of_two=True),
        head_dim_align=16,
        validation=("Triton interpreter on CPU (conformance in CI); real GPU: " + GPU_VALIDATION) if interp
        else ("Triton kernels on a CUDA device; real GPU: " + GPU_VALIDATION),
        always_check_values=interp,
        fuzz_examples=INTERPRETED_FUZZ if interp else None,
        draw_share=INTERPRETED_DRAWS if interp else 1.0,
        devices=("cuda",),
        collective="gloo" if interp else "nccl",
        memory=None if interp else _memory,
        synchronize=(lambda: None) if interp else _synchronize,
    ))
