"""The runner's layers in one native call (`layer_loop.cpp`): for a batch-invariant CPU model
whose linear weights all run int4 as stored, each layer's steps (the fused row kernels and
ATen's int4pack matmul on the plan's chunks, or the q4q8 kernel of `hal.models.q4_rows`) in
the order the Python loop of `hal.models.llama.Llama.forward` runs them, so the bits are the
Python loop's (`tests/models/test_layer_loop.py`); what goes is the Python and dispatch between
the steps. What the backend's checked ``write_kv`` refuses in the Python loop's first layer is
refused here before anything is written: a slot outside the cache (the kernels check every
slot and block id first) or a slot repeated (checked in `LayerLoop.run`).

Built on first use with the C++ compiler against the installed torch (headers and libraries
of the wheel), cached like the row kernels (`hal.models.native`); where it does not build,
the Python loop runs, with a warning."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from hal.errors import HalError
from hal.models import int4, k_quants, native, q4_rows, row_kernels
from hal.models.invariant import KeyLists

SOURCE = Path(__file__).with_name("layer_loop.cpp")
_P, _I = ctypes.c_void_p, ctypes.c_int64


class LayerWeights(ctypes.Structure):
    """One layer's weights as the native loop reads them (``LayerWeights`` in layer_loop.cpp,
    which asserts the same size): norms, the four linears as stored (packed, scales-zeros),
    the family's extras (q/k/v biases, o bias, q and k norms; NULL where it has none), and
    each linear's tiles (`hal.models.q4_rows.Q4Weight.kind`; int4pack's form: 0) and its rows'
    codes per input (`Q4Weight.codes`)."""

    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("packed", _P * 4), ("sz", _P * 4), ("bqkv", _P), ("bo", _P),
                ("q_norm", _P), ("k_norm", _P), ("kind", _I * 4),
                ("packed2", _P * 4), ("kind2", _I * 4), ("rows1", _I * 4), ("codes", _I * 4)]


assert ctypes.sizeof(LayerWeights) == 18 * ctypes.sizeof(_P) + 16 * ctypes.sizeof(_I)


class LoopCall(ctypes.Structure):
    """One forward's shapes, metadata and buffers by name (``LoopCall`` in layer_loop.cpp, which
    asserts the same size and describes each field)."""

    _fields_ = [*((n, _I) for n in ("T", "H", "Hq", "Hkv", "D", "F", "nblocks", "bs", "R", "nb", "bts", "E",
                                    "act_bf16", "cache_bf16", "interleaved", "q4")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("rot", _P), ("rs", _I),
                *((n, _P) for n in ("slot_of", "bt", "req", "n_cache", "extra", "n_extra", "widths")),
                ("nwidths", _I), ("layers", _P), ("k_caches", _P), ("v_caches", _P), ("taps", _P), ("ntaps", _I),
                ("tap_out", _P)]


assert ctypes.sizeof(LoopCall) == 16 * ctypes.sizeof(_I) + 2 * ctypes.sizeof(ctypes.c_float) + 16 * ctypes.sizeof(_P)
ARGS = [_I, _I, _P, _P, ctypes.POINTER(LoopCall), ctypes.c_char_p, _I]   # first, last, h, d, the call, err, errlen


def build(compiler: str | None = None) -> Path:
    """The compiled layer loop for this CPU and this torch (compiled when not cached)."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    flags, libs = native.torch_flags(row_kernels.flags())
    return native.compile_library("layer loop", [SOURCE, row_kernels.SOURCE, q4_rows.SOURCE, q4_rows.KERNEL, q4_rows.Q8_TILES], cxx,
                                  flags, libs)


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _loaded:
            try:
                lib = ctypes.CDLL(str(build()))
                lib.layer_loop.argtypes, lib.layer_loop.restype = ARGS, _I
                _loaded["lib"] = lib
            except (HalError, OSError) as e:
                warnings.warn(f"spec-hal: the native layer loop did not build, so the runner's layers run from "
                              f"Python (slower, same bits): {e}", RuntimeWarning, stacklevel=3)
                _loaded["lib"] = None
        return _loaded["lib"]


def applies(model) -> bool:
    """Whether a model's forwards can run here: batch-invariant on the CPU with the fused row
    kernels, every layer's linear weight as stored for the plan's rows (int4pack's form, or
    q4q8's Q4 or Q8 tiles), no custom layout."""
    if not (model.batch_invariant and model.device.type == "cpu" and isinstance(model.rows, row_kernels.FusedRows)
            and model.plan.weights in ("int4", "q4q8") and model.plan.fn is None):
        return False
    cfg = model.cfg
    nq, nkv = cfg.heads * cfg.head_dim, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    shapes = {"wqkv": (nkv, cfg.hidden), "wo": (cfg.hidden, nq), "wgu": (2 * cfg.ffn, cfg.hidden),
              "wdown": (cfg.hidden, cfg.ffn)}   # what the native loop reads: [N, K], packed [N, K/2]
    packed_as = _tiled_as if model.plan.weights == "q4q8" else _packed_as
    return all(packed_as(model.w[f"{i}.{k}"], n, kk, model.plan.dtype)
               for i in range(model.num_layers) for k, (n, kk) in shapes.items())


def _tiled_as(w, N: int, K: int, dtype: torch.dtype) -> bool:   # Q4, Q8, Q6 or Q4K tiles, or two parts of them
    parts = w.parts if isinstance(w, k_quants.MixedWeight) else (w,)
    return len(parts) <= 2 and all(isinstance(p, q4_rows.Q4Weight) and p.dtype == dtype for p in parts) \
        and tuple(w.shape) == (N, K)


def _packed_as(w, N: int, K: int, dtype: torch.dtype) -> bool:
    return (isinstance(w, int4.Int4Weight) and w.repeat == 1 and w.dtype == dtype and tuple(w.shape) == (N, K)
            and w.packed.dtype == torch.uint8 and tuple(w.packed.shape) == (N, K // 2) and w.packed.is_contiguous()
            and tuple(w.scales_zeros.shape) == (K // int4.GROUP, N, 2) and w.scales_zeros.is_contiguous())


class LayerLoop:
    """One model's weights as the native loop reads them (pointer arrays, built once; the
    model's weight dict keeps the tensors alive and is not changed after loading)."""

    def __init__(self, model, lib: ctypes.CDLL):
        self.lib, self.cfg, self.layers = lib, model.cfg, model.num_layers
        self.q4 = model.plan.weights == "q4q8"
        self._keep = []
        self.weights = (LayerWeights * self.layers)()
        for i, lw in enumerate(self.weights):
            def ptr(name, w=model.w):   # float32 contiguous, kept alive here; 0 where the family has none
                t = w.get(f"{i}.{name}")
                if t is None:
                    return None
                self._keep.append(t := t.float().contiguous())
                return t.data_ptr()
            lw.attn_norm, lw.ffn_norm = ptr("attn_norm"), ptr("ffn_norm")
            for j, key in enumerate(("wqkv", "wo", "wgu", "wdown")):
                w = model.w[f"{i}.{key}"]
                self._keep.append(w)
                first, *second = w.parts if isinstance(w, k_quants.MixedWeight) else (w,)
                lw.packed[j] = first.packed.data_ptr()
                lw.sz[j] = (first.packed if self.q4 else first.scales_zeros).data_ptr()   # q4q8: unused
                lw.kind[j] = first.kind if self.q4 else 0
                lw.codes[j] = w.codes if self.q4 else 0
                if second:   # two parts of different tiles (`LayerWeights.rows1`)
                    lw.packed2[j], lw.kind2[j], lw.rows1[j] = second[0].packed.data_ptr(), second[0].kind, first.shape[0]
            lw.bqkv, lw.bo, lw.q_norm, lw.k_norm = ptr("bqkv"), ptr("bo"), ptr("q_norm"), ptr("k_norm")
        self.act = model.plan.dtype

    def run(self, h: Tensor, keys: KeyLists, rot: Tensor, widths: list[int], k_caches: list[Tensor],
            v_caches: list[Tensor], taps: tuple[int, ...], eps: float, scale: float) -> Tensor:
        """Every layer of a forward: ``h`` [T, H] float32, the embedding, written in place; the
        last layer's output is added too. Returns [T, len(taps) * H]: each row's h entering each
        layer of ``taps``, in order (the layer count: h at the end), side by side (a feature
        drafter's layout)."""
        cfg, (T, H) = self.cfg, h.shape
        if h.dtype != torch.float32 or not h.is_contiguous():
            raise HalError(f"h: expected a contiguous float32 [T, H], got {h.dtype} strides {h.stride()}", arg="h")
        _check_metadata(keys, rot, widths, T, cfg.head_dim)
        _distinct_slots(keys.slot_of)
        if len(k_caches) < self.layers or len(v_caches) < self.layers:
            raise HalError(f"k_caches: expected one per layer ({self.layers}), got {len(k_caches)} and "
                           f"{len(v_caches)}", arg="k_caches")
        kc = k_caches[0]
        nblocks, bs = kc.shape[:2]
        for c in (*k_caches[:self.layers], *v_caches[:self.layers]):
            if c.shape != kc.shape or c.dtype != kc.dtype or not c.is_contiguous() or not c.is_cpu:
                raise HalError(f"k_caches: expected contiguous host caches like {list(kc.shape)} {kc.dtype}",
                               arg="k_caches")
        cs = torch.view_as_real(rot.contiguous())
        tap_layers = list(taps)
        tap_out = torch.empty(T, len(tap_layers), H)
        kept = [(ctypes.c_int64 * len(widths))(*widths), _pointers(k_caches[:self.layers]),
                _pointers(v_caches[:self.layers]), (ctypes.c_int64 * max(len(tap_layers), 1))(*tap_layers)]
        bt = keys.block_tables
        call = LoopCall(T=T, H=H, Hq=cfg.heads, Hkv=cfg.kv_heads, D=cfg.head_dim, F=cfg.ffn, nblocks=nblocks, bs=bs,
                        R=bt.shape[0], nb=bt.shape[1], bts=bt.stride(0), E=keys.extra.shape[1],
                        act_bf16=int(self.act == torch.bfloat16), cache_bf16=int(kc.dtype == torch.bfloat16),
                        interleaved=int(cfg.rope_interleaved), q4=int(self.q4), eps=eps, scale=scale,
                        rot=cs.data_ptr(), rs=cs.stride(0), slot_of=keys.slot_of.data_ptr(), bt=bt.data_ptr(),
                        req=keys.req.data_ptr(), n_cache=keys.n_cache.data_ptr(), extra=keys.extra.data_ptr(),
                        n_extra=keys.n_extra.data_ptr(), widths=ctypes.addressof(kept[0]), nwidths=len(widths),
                        layers=ctypes.addressof(self.weights), k_caches=ctypes.addressof(kept[1]),
                        v_caches=ctypes.addressof(kept[2]), taps=ctypes.addressof(kept[3]), ntaps=len(tap_layers),
                        tap_out=tap_out.data_ptr())
        err = ctypes.create_string_buffer(512)
        rc = self.lib.layer_loop(0, self.layers, h.data_ptr(), None, ctypes.byref(call), err, 512)
        if rc:
            raise HalError(f"batch: expected a forward the layer loop can run, got: {err.value.decode()}", arg="batch")
        return tap_out.view(T, -1)


def _check_metadata(keys: KeyLists, rot: Tensor, widths: list[int], T: int, D: int) -> None:
    """What the native loop reads without bounds of its own: the key lists' arrays (int64,
    contiguous, one entry or row per query row), the rotations, and chunks covering every row."""
    for name, t, shape in (("slot_of", keys.slot_of, (T,)), ("req", keys.req, (T,)), ("n_cache", keys.n_cache, (T,)),
                           ("n_extra", keys.n_extra, (T,)), ("extra", keys.extra, (T, keys.extra.shape[-1])),
                           ("block_tables", keys.block_tables, tuple(keys.block_tables.shape[-2:]))):
        if t is None or t.dtype != torch.long or tuple(t.shape) != shape or not t.is_contiguous():
            raise HalError(f"keys.{name}: expected contiguous int64 {list(shape)}, got "
                           f"{None if t is None else (t.dtype, list(t.shape))}", arg="keys")
    if rot.dtype != torch.complex64 or rot.shape != (T, D // 2):
        raise HalError(f"rot: expected complex64 [{T}, {D // 2}], got {rot.dtype} {list(rot.shape)}", arg="rot")
    if not widths or min(widths) < 1 or sum(widths) < T:
        raise HalError(f"widths: expected chunk widths covering {T} rows, got {widths}", arg="widths")


def _distinct_slots(slots: Tensor) -> None:
    """The checked ``write_kv``'s rule for a forward's first KV writes: no slot twice (-1 skips)."""
    if slots.numel() > 1:
        live = slots[slots >= 0]
        if live.unique().numel() != live.numel():
            raise HalError("slot_mapping: expected distinct slots (besides -1), got a repeated slot",
                           arg="slot_mapping")


def _pointers(tensors: list[Tensor]):
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def loop_for(model) -> LayerLoop | None:
    """The native loop for ``model`` when it applies and builds; None otherwise."""
    if not applies(model):
        return None
    lib = _library()
    return None if lib is None else LayerLoop(model, lib)
