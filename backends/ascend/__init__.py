"""The ascend backend: Huawei Ascend NPUs through torch_npu.

KV writes and paged attention map onto torch_npu's fused ops (``npu_scatter_pa_kv_cache``,
``npu_fused_infer_attention_score``), sampling onto ``npu_top_k_top_p``; the verify ops
are ``torch.library`` custom ops composed of torch ops (aclnn on the NPU). Every
torch_npu call goes through `backends.ascend._adapter`.

Real when torch_npu imports and an NPU is present; emulated on CPU tensors with
``HAL_ASCEND_EMULATE=1`` (each torch_npu op replaced by a CPU reference of its
documented semantics); otherwise unavailable, with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from hal import BackendSpec, BlockSizes, hookimpl

VALIDATION = ("schema- and shape-verified against torch-npu 2.13.0; semantics emulated on CPU; "
              "not executed on an NPU")


def emulated() -> bool:
    return os.environ.get("HAL_ASCEND_EMULATE", "0") == "1"


def _probe() -> str | None:
    if emulated():
        return None
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (set HAL_ASCEND_EMULATE=1 to emulate the NPU ops on CPU)"
    # torch autoloads installed device backends at `import torch` unless TORCH_DEVICE_BACKEND_AUTOLOAD=0
    # (without CANN that autoload breaks `import torch` itself); with autoload off we import it here.
    try:
        importlib.import_module("torch_npu")
        import torch
        if not torch.npu.is_available():
            return "torch_npu imports but no NPU is visible"
    except Exception as e:  # noqa: BLE001 (a broken CANN install must not take the registry down)
        return f"torch_npu failed to import ({type(e).__name__}: {e}); CANN missing?"
    return None


def _synchronize() -> None:
    import torch
    torch.npu.synchronize()


def _memory(index: int) -> tuple[int, int]:
    import torch
    return torch.npu.mem_get_info(index)


@hookimpl
def register_backends(register):
    emu = emulated()
    register(BackendSpec(
        name="ascend",
        device_type="cpu" if emu else "npu",
        load=lambda: importlib.import_module("backends.ascend.ops"),
        probe=_probe,
        priority=-20 if emu else 10,  # auto never prefers the emulation over cpu
        block_sizes=BlockSizes(lo=128, hi=512, multiple_of=128, power_of_two=False),
        head_dim_align=16,
        validation=("emulated: " if emu else "") + VALIDATION,
        always_check_values=emu,
        devices=("npu",),
        collective="gloo" if emu else "hccl",
        memory=None if emu else _memory,
        synchronize=(lambda: None) if emu else _synchronize,
    ))
