"""The runner's per-row work between its matmuls: RMSNorm (after the residual add), SwiGLU,
RoPE (with the KV write, ``rope_kv``) and the batch-invariant paged attention, in one of two
implementations with one interface (`Rows`):

- `FusedRows`: `row_kernels.c`, one call per step, compiled on first use for this CPU by
  the system's C compiler (``-O3 -march=native -ffp-contract=off``) into ``$HAL_CACHE/kernels``
  and called through ctypes. Eager PyTorch spends about ten ATen calls on one RMSNorm and its
  casts; here it is one call. Each row is computed by the same code whatever the row count,
  so a row's bits do not depend on its batch-mates (`tests/models/test_row_kernels.py`).
- `EagerRows`: the same steps as ATen ops, attention as `hal.models.invariant.attention`
  (the runner's arithmetic before these kernels, bit for bit); used where the kernels do not
  apply (tensors off the CPU) or do not build, with a warning that says why.

Shapes: the residual stream ``h`` [T, H] float32; activations (a matmul's rows and outputs)
[T, ·] float32 or bfloat16; norm weights [H] float32; RoPE rotations ``rot`` [T, D/2]
complex64 (unit, from `hal.models.rope.Rope`)."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.errors import HalError
from hal.models import invariant
from hal.models import native

SOURCE = Path(__file__).with_name("row_kernels.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
MARCH_ENV = "HAL_MARCH"   # another -march than native: code for an older CPU of a cluster (or to measure its paths)
ACTIVATIONS = (torch.float32, torch.bfloat16)
_KIND = {torch.float32: 0, torch.bfloat16: 1}   # an activation dtype -> the kernels' bfloat16 flag
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {   # each function's (argument types, return type)
    "add_norm": ([_P, _I, _P, _I, ctypes.c_int, _P, _F, _P, _I, ctypes.c_int, _I, _I], None),
    "silu_mul": ([_P, _I, _I, _P, _I, ctypes.c_int, _I], None),
    "head_norm": ([_P, _I, ctypes.c_int, _P, _F, _I, _I, _I], None),
    "rope": ([_P, _I, ctypes.c_int, _P, _I, _P, _I, _I, _I, ctypes.c_int], None),
    "rope_kv": ([_P, _I, ctypes.c_int, _P, _I, _P, _I, _I, _I, _I, ctypes.c_int, _P, _P, ctypes.c_int, _P, _I], _I),
    "attention": ([_P, _I, _I, _I, _P, _P, ctypes.c_int, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P, _I, _P, _F, _P], _I),
}
ATTENTION_ERRORS = {1: "a query's request outside the block tables", 2: "a key count past its block table",
                    3: "a block id outside the cache", 4: "a tree slot outside the cache", 5: "memory for the scores"}
MAX_GROUP = 16    # query heads per KV head the fused attention takes (MAXG in row_kernels.c)


class EagerRows:
    """The per-row steps as ATen ops (functional: ``h`` is never written in place)."""

    describe = "eager ATen ops"

    def attends(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """False: attention runs as `hal.models.invariant.attention`."""
        return False

    def add_norm(self, h: Tensor, d: Tensor | None, w: Tensor | None, eps: float,
                 dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:
        """``h + d`` (d None: ``h``) and its RMSNorm by ``w`` (w None: no norm), the norm
        float32 here (the next matmul casts it to ``dtype``, the rows it multiplies)."""
        if d is not None:
            h = h + d.float()
        return h, None if w is None else F.rms_norm(h, w.shape, w, eps)

    def head_norm(self, x: Tensor, heads: int, w: Tensor, eps: float) -> Tensor:
        """``x`` [T, heads·D] RMS-normed per head as ``Qwen3RMSNorm`` (float32, the weight after
        casting back), in ``x``'s dtype."""
        from hal.models.families import head_norm
        return head_norm(x, heads, w, eps, x.dtype)

    def silu_mul(self, gu: Tensor) -> Tensor:
        """``silu(gate) * up`` of ``gu`` = [gate | up] [T, 2F]."""
        gate, up = gu.float().split(gu.shape[1] // 2, -1)
        return F.silu(gate) * up

    def rope(self, x: Tensor, rot: Tensor, heads: int, interleaved: bool) -> Tensor:
        """``x`` [T, heads·D] rotated, as float32 [T, heads, D]."""
        T, D = x.shape[0], x.shape[1] // heads
        x = x.float().reshape(T, heads, D)
        if interleaved:
            return torch.view_as_real(torch.view_as_complex(x.reshape(T, heads, -1, 2)) * rot[:, None]).flatten(-2)
        z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * rot[:, None]
        return torch.cat([z.real, z.imag], -1)


class FusedRows:
    """The per-row steps as `row_kernels.c` (``add_norm`` writes ``h`` in place)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.lib, self.describe = lib, f"fused C row kernels ({path.name})"
        for name, (args, result) in SIGNATURES.items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result

    def add_norm(self, h: Tensor, d: Tensor | None, w: Tensor | None, eps: float,
                 dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:
        if h.dtype != torch.float32 or not h.is_cpu or h.dim() != 2 or not h.is_contiguous():
            raise HalError(f"h: expected a contiguous float32 [T, H] host tensor (written in place), got {h.dtype} "
                           f"{list(h.shape)} strides {h.stride()} on {h.device}", arg="h")
        T, H = shape = h.shape
        d, d_bf16 = (None, 0) if d is None else _act(d, "d", shape)
        out = None
        if w is not None:
            if w.dtype != torch.float32 or not w.is_cpu or w.shape != shape[1:] or not w.is_contiguous():
                raise HalError(f"w: expected contiguous float32 [{H}] on cpu, got {w.dtype} {list(w.shape)}", arg="w")
            if dtype not in _KIND:
                raise HalError(f"dtype: expected one of {ACTIVATIONS}, got {dtype}", arg="dtype")
            out = torch.empty(T, H, dtype=dtype)
        self.lib.add_norm(h.data_ptr(), H, None if d is None else d.data_ptr(), 0 if d is None else d.stride(0), d_bf16,
                          None if w is None else w.data_ptr(), eps, None if out is None else out.data_ptr(), H,
                          _KIND[dtype], T, H)
        return h, out

    def head_norm(self, x: Tensor, heads: int, w: Tensor, eps: float) -> Tensor:
        """``x`` [T, heads·D] (a view with unit column stride: written in place) RMS-normed per head
        (`row_kernels.c` ``head_norm``: float32, rounded once); returns ``x``."""
        T, n = x.shape if x.dim() == 2 else (0, 0)
        D = n // max(heads, 1)
        if heads < 1 or n % heads or x.dtype not in _KIND or not x.is_cpu or (T and x.stride(1) != 1):
            raise HalError(f"x: expected activations [T, heads·D] with unit column stride for {heads} heads, got "
                           f"{x.dtype} {list(x.shape)} strides {x.stride()}", arg="x")
        if w.dtype != torch.float32 or not w.is_cpu or tuple(w.shape) != (D,) or not w.is_contiguous():
            raise HalError(f"w: expected contiguous float32 [{D}] on cpu, got {w.dtype} {list(w.shape)}", arg="w")
        if T:
            self.lib.head_norm(x.data_ptr(), x.stride(0), _KIND[x.dtype], w.data_ptr(), eps, T, heads, D)
        return x

    def silu_mul(self, gu: Tensor) -> Tensor:
        T, F2 = gu.shape if gu.dim() == 2 else (0, 1)
        if F2 % 2:
            raise HalError(f"gu: expected [T, 2F] (gate | up), got {list(gu.shape)}", arg="gu")
        gu, bf = _act(gu, "gu", gu.shape)
        out = torch.empty(T, F2 // 2, dtype=gu.dtype)
        self.lib.silu_mul(gu.data_ptr(), gu.stride(0), F2 // 2, out.data_ptr(), F2 // 2, bf, T)
        return out

    def rope(self, x: Tensor, rot: Tensor, heads: int, interleaved: bool) -> Tensor:
        if x.dim() != 2:
            raise HalError(f"x: expected [T, heads·D], got {list(x.shape)}", arg="x")
        T, n = x.shape
        D = n // heads
        if heads < 1 or n % heads or D % 2:
            raise HalError(f"x: expected [T, heads·D] with D even for {heads} heads, got {list(x.shape)}", arg="x")
        x, bf, cs = self._rope_args(x, rot, T, D)
        out = torch.empty(T, heads, D, dtype=torch.float32)
        self.lib.rope(x.data_ptr(), x.stride(0), bf, cs.data_ptr(), cs.stride(0), out.data_ptr(), T, heads, D,
                      int(interleaved))
        return out

    def rope_kv(self, qkv: Tensor, rot: Tensor, heads: int, kv_heads: int, interleaved: bool, k_cache: Tensor,
                v_cache: Tensor, slots: Tensor) -> Tensor:
        """A layer's fused projection ``qkv`` [T, (heads + 2 kv_heads)·D]: its keys rotated and
        its values written to the contiguous host caches at ``slots`` [T] int64 (-1: not
        written), as the backend's ``write_kv`` would; the queries rotated, float32 [T, heads, D]."""
        T, n = qkv.shape if qkv.dim() == 2 else (0, -1)
        nb, bs, Hkv, D = k_cache.shape
        if Hkv != kv_heads or n != (heads + 2 * kv_heads) * D:
            raise HalError(f"qkv: expected [T, {(heads + 2 * kv_heads) * D}] for {heads} + 2 x {kv_heads} heads of "
                           f"the cache's {D}, got {list(qkv.shape)}", arg="qkv")
        _caches(k_cache, v_cache)
        x, bf, cs = self._rope_args(qkv, rot, T, D)
        if slots.dtype != torch.long or slots.shape != (T,) or not slots.is_contiguous():
            raise HalError(f"slots: expected contiguous int64 [{T}], got {slots.dtype} {list(slots.shape)}", arg="slots")
        out = torch.empty(T, heads, D, dtype=torch.float32)
        if self.lib.rope_kv(x.data_ptr(), x.stride(0), bf, cs.data_ptr(), cs.stride(0), out.data_ptr(), T, heads,
                            kv_heads, D, int(interleaved), k_cache.data_ptr(), v_cache.data_ptr(), _KIND[k_cache.dtype],
                            slots.data_ptr(), nb * bs):
            raise HalError(f"slots: expected -1 or slots below the cache's {nb * bs}, got {slots.tolist()}",
                           arg="slots")
        return out

    @staticmethod
    def _rope_args(x: Tensor, rot: Tensor, T: int, D: int) -> tuple[Tensor, int, Tensor]:
        x, bf = _act(x, "x", x.shape)
        if rot.dtype != torch.complex64 or rot.shape != (T, D // 2) or not rot.is_cpu:
            raise HalError(f"rot: expected complex64 [{T}, {D // 2}] on cpu, got {rot.dtype} {list(rot.shape)} "
                           f"on {rot.device}", arg="rot")
        return x, bf, torch.view_as_real(rot if rot.stride(1) == 1 else rot.contiguous())

    def attends(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether `attention` takes these shapes (a model's, fixed for its life: a model whose
        shapes it does not take runs every forward's attention eager)."""
        return heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and head_dim % 16 == 0 and head_dim <= 128

    def attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, keys: invariant.KeyLists,
                  scale: float) -> Tensor:
        """Causal paged attention of ``q`` [T, Hq, D] over contiguous host caches
        [blocks, bs, Hkv, D] (float32 or bfloat16), each query row reading the keys ``keys``
        lists for it (a tree node's in chain order); [T, Hq, D] float32."""
        T, Hq, D = q.shape
        nb, bs, Hkv, Dk = k_cache.shape
        if not self.attends(Hq, Hkv, D) or Dk != D:
            raise HalError(f"q: expected heads a multiple (<= {MAX_GROUP}x) of the cache's {Hkv} KV heads and a head "
                           f"dim of 16·n <= 128 equal to its {Dk}, got {list(q.shape)}", arg="q")
        _caches(k_cache, v_cache)
        if q.dtype != torch.float32 or not q.is_cpu:
            raise HalError(f"q: expected float32 [T, Hq, D] on cpu, got {q.dtype} on {q.device}", arg="q")
        q = q.contiguous()
        if keys.req.shape != (T,) or keys.extra.shape[0] != T or not keys.extra.is_contiguous():
            raise HalError(f"keys: expected key lists for {T} query rows, got {keys.req.shape[0]}", arg="keys")
        out = torch.empty(T, Hq, D, dtype=torch.float32)
        bt, extra = keys.block_tables, keys.extra
        err = self.lib.attention(q.data_ptr(), T, Hq, D, k_cache.data_ptr(), v_cache.data_ptr(), _KIND[k_cache.dtype], Hkv,
                                 bs, nb, bt.data_ptr(), bt.shape[0], bt.shape[1], bt.stride(0), keys.req.data_ptr(),
                                 keys.n_cache.data_ptr(), extra.data_ptr(), extra.shape[1], keys.n_extra.data_ptr(),
                                 scale, out.data_ptr())
        if err:
            raise HalError(f"batch: expected block tables, sequence lengths and tree slots within the cache's {nb} "
                           f"blocks of {bs}, got {ATTENTION_ERRORS.get(err, f'error {err}')}", arg="batch")
        return out


Rows = EagerRows | FusedRows


def _caches(k_cache: Tensor, v_cache: Tensor) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.device.type != "cpu" or c.dtype not in ACTIVATIONS or not c.is_contiguous() or c.shape != k_cache.shape \
                or c.dtype != k_cache.dtype:
            raise HalError(f"{name}: expected a contiguous host cache like k_cache {list(k_cache.shape)} "
                           f"{k_cache.dtype}, got {list(c.shape)} {c.dtype} on {c.device}", arg=name)


def _act(t: Tensor, name: str, shape: torch.Size) -> tuple[Tensor, int]:
    """``t`` with unit-stride rows (any strides accepted: a copy when they are not) and the
    kernels' bfloat16 flag; HalError unless a float32 or bfloat16 host tensor of ``shape``."""
    kind = _KIND.get(t.dtype)
    if kind is None or not t.is_cpu or t.shape != shape or len(shape) != 2:
        raise HalError(f"{name}: expected float32 or bfloat16 {list(shape)} on cpu, got {t.dtype} {list(t.shape)} "
                       f"on {t.device}", arg=name)
    st = t.stride()
    return (t if st[1] == 1 and st[0] >= shape[1] else t.contiguous()), kind


_lock = threading.Lock()
_loaded: dict[str, Rows] = {}


def rows_for(device: torch.device) -> Rows:
    """The fused kernels for CPU tensors, built once per process (loudly eager where they
    do not build); eager ATen ops on any other device."""
    if torch.device(device).type != "cpu":
        return EagerRows()
    with _lock:
        if "cpu" not in _loaded:
            try:
                path = build()
                _loaded["cpu"] = FusedRows(ctypes.CDLL(str(path)), path)
            except (HalError, OSError) as e:
                warnings.warn(f"spec-hal: the fused row kernels did not build, so the runner uses eager ATen ops "
                              f"(slower, same contract): {e}", RuntimeWarning, stacklevel=2)
                _loaded["cpu"] = EagerRows()
        return _loaded["cpu"]


def build(compiler: str | None = None) -> Path:
    """The compiled kernels for this CPU: ``$HAL_CACHE/kernels/row_kernels-<key>.so``
    (`hal.models.native`), compiled when not cached. HalError when there is no
    C compiler or it fails."""
    cc = compiler or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    return native.compile_library("row kernels", [SOURCE], cc, flags(), ("-lm",))


def flags() -> tuple[str, ...]:
    """`FLAGS`, with ``-march=$HAL_MARCH`` where that is set."""
    march = os.environ.get(MARCH_ENV)
    return tuple(f"-march={march}" if f == "-march=native" and march else f for f in FLAGS)
