"""Weights as stored times rows quantized to int8: llama.cpp's arithmetic for Q4_1 x Q8_1 and
Q8_0 x Q8_0, as integer dot products (`q4_rows.c`: AVX-512 VNNI, else AVX2, else plain C;
`q4_mm.cpp`: torch's intra-op threads split the output tiles). A linear plan runs it as
``weights="q4q8"`` (`hal.models.linear_layout`).

Why: PyTorch's int4pack kernel costs about 2.5x at 8 rows what it costs at one, so a verify
of k drafts costs several decodes and speculation cannot pay on a CPU. Integer dot products
put the cost in the weight reads, which every row shares.

What changes in the numbers: each row is quantized per 32 inputs (a scale per 32, as
llama.cpp does before every quantized matmul) to two int8 codes per input, a value and its
residual (``codes`` 2: about 15 bits), or to one (``codes`` 1: llama.cpp's int8 rows, half the
integer dot products; what a K-quant file runs, `hal.models.loaders.file_row_codes`), so a
product is off by about half a step of that scale per input. The integer sums are exact, and the float steps (one scale
product and two adds per group, in group order, no contraction) are the same on every code
path and for every row count: a row's bits never depend on its batch-mates, the thread count
or the CPU's vector width (`tests/models/test_q4_rows.py` compares all three, and the bits
against `hal.models.q4_reference.reference_mm`, the torch statement of the arithmetic).

Glossary: see `q4_rows.c` (tile, Q8 tile, quantized row) and `hal.models.int4` (blocks)."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from hal.errors import HalError
from hal.models import huge_pages, int4, native

SOURCE = Path(__file__).with_name("q4_mm.cpp")
KERNEL = Path(__file__).with_name("q4_rows.c")
Q8_TILES = Path(__file__).with_name("q8_tiles.c")   # included by q4_rows.c
TILE = 16                    # outputs per tile
BYTES = (320, 544, 420, 296, 352, 360, 288)   # per (tile, group of 32 inputs), by kind (K-quants: with a share of their heads)
Q4_BYTES, Q8_BYTES, Q6_BYTES, Q4K_BYTES, Q5_BYTES, Q5K_BYTES, Q40_BYTES = BYTES
Q4_KIND, Q8_KIND, Q6_KIND, Q4K_KIND, Q5_KIND, Q5K_KIND, Q40_KIND = range(7)   # a packed weight's tiles, as q4_rows.c numbers them
SUPER = 8                    # groups per K-quant super-block (256 inputs): Q6, Q4K and Q5K tiles keep its d (dmin) once
SUPER_KINDS = (Q6_KIND, Q4K_KIND, Q5K_KIND)
ROWS = (torch.float32, torch.bfloat16)
CODES = (1, 2)               # int8 codes per input of a quantized row (`Q4Weight.codes`)
ROW_WORDS = {1: "one int8 code per input (llama.cpp's int8 rows)", 2: "int8 value and residual codes"}
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(eq=False)
class Q4Weight:
    """A linear weight ``[N, K]`` in tiles (`q4_rows.c`): Q4 (codes, fp16 d and m; ``q40``: a
    Q4_0 weight's, m = −8·d not stored), Q8 (codes + 128, fp16 d) or Q6 (``q6k``: Q6_K's 6-bit
    codes, int8 scale per 16, fp16 d per super-block of 256; K-quant tiles keep d once per super-block). ``dtype``: the plan's row dtype, rows are cast to it before they are quantized (so a
    row is quantized from the values the int4pack form would multiply)."""

    packed: Tensor            # uint8 [N/16, K/32, BYTES[kind]]; K-quant kinds: [N/16, K/256, 8·BYTES[kind]]
    shape: tuple[int, int]    # the logical [N, K]
    q8: bool
    dtype: torch.dtype
    q6k: bool = False
    q4k: bool = False
    q5: bool = False          # codes of 5 bits: a Q4 (Q5_0) or, with q4k, Q4K (Q5_K) tile and their fifth bits
    q40: bool = False         # a Q4 tile without m: w = d·(q − 8), Q4_0 as stored (4.5 bits a weight, not 5)
    codes: int = 2            # int8 codes per input of a quantized row: 2 (hi and lo, ~15 bits) or 1 (llama.cpp's int8)

    @property
    def kind(self) -> int:
        if self.q4k:
            return Q5K_KIND if self.q5 else Q4K_KIND
        return Q6_KIND if self.q6k else Q5_KIND if self.q5 else Q8_KIND if self.q8 else Q40_KIND if self.q40 \
            else Q4_KIND

    def __post_init__(self):
        N, K = self.shape
        per = SUPER if self.kind in SUPER_KINDS else 1
        want = (N // TILE, K // int4.GROUP // per, per * BYTES[self.kind])
        if not int4.fits(N, K) or self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != want \
                or not self.packed.is_contiguous() or self.dtype not in ROWS or self.codes not in CODES:
            raise HalError(f"weight: expected contiguous uint8 tiles {list(want)} for [{N}, {K}] (N a multiple of "
                           f"16, K of 32), rows in {ROWS} of {CODES} codes, got {self.packed.dtype} "
                           f"{list(self.packed.shape)}, rows {self.dtype} of {self.codes}", arg="weight")

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def mm(self, x: Tensor) -> Tensor:
        """``x @ W.T`` for ``x`` [T, K] (any float dtype: cast to `dtype` first); [T, N] float32."""
        N, K = self.shape
        if x.dim() != 2 or x.shape[1] != K or not x.is_floating_point() or x.device.type != "cpu":
            raise HalError(f"x: expected float rows [T, {K}] on the CPU, got {x.dtype} {list(x.shape)} on "
                           f"{x.device}", arg="x")
        x = x.to(self.dtype)
        if x.stride(1) != 1 or x.stride(0) < K:
            x = x.contiguous()
        T = x.shape[0]
        y = torch.empty(T, N)
        if T and library().q4_mm(self.packed.data_ptr(), self.kind, self.codes, N, K, x.data_ptr(),
                                 int(self.dtype == torch.bfloat16), T, x.stride(0), y.data_ptr()):
            raise HalError(f"x: expected rows the q4q8 kernel can multiply, got a failed call for {list(x.shape)}",
                           arg="x")
        return y

    def with_codes(self, codes: int) -> "Q4Weight":
        """This weight (its tiles shared) multiplying rows of ``codes`` int8 codes per input."""
        return replace(self, codes=codes)

    def to(self, device) -> "Q4Weight":
        if torch.device(device).type != "cpu":
            raise HalError(f"device: expected cpu for a q4q8 weight (the kernel is the CPU's), got {device}",
                           arg="device")
        return self


def pack(blocks: int4.Int4Blocks, dtype: torch.dtype) -> Q4Weight:
    """Q4 tiles of int4 blocks (``w = (q - 8)·scale + zero``: d = scale, m = the stored min, or
    zero - 8·scale), whose d and m are fp16 values, as a GGUF file stores them. `HalError`
    naming ``weight`` otherwise: nothing is rounded here. Where every m is −8·d (Q4_0), the
    tiles leave m out (``q40``): the kernel forms it as d·(−8), the same float32 value, so the
    products are the same bits in 10% fewer bytes."""
    N, K = blocks.codes.shape
    d = blocks.scales
    m = blocks.zeros - 8 * blocks.scales if blocks.mins is None else blocks.mins
    if not (torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m)):
        raise HalError("weight: expected int4 blocks whose scales and mins are fp16 values (as stored in a GGUF "
                       "file), got values fp16 would round", arg="weight")
    NT, G = N // TILE, K // int4.GROUP
    c = blocks.codes.to(torch.uint8).view(NT, TILE, G, 4, 2, 4)   # k = 32g + 8s + 4·nibble + j
    codes = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(NT, G, 256)
    q40 = torch.equal(m, -8 * d)
    packed = huge_pages.resident(torch.cat([codes, _lanes([d] if q40 else [d, m])], -1).contiguous())
    return Q4Weight(packed, (N, K), False, dtype, q40=q40)


def pack_q8(q: Tensor, d: Tensor, dtype: torch.dtype) -> Q4Weight:
    """Q8 tiles of int8 codes ``q`` [N, K] with fp16-valued scales ``d`` [N, K/32]."""
    N, K = q.shape
    if not int4.fits(N, K) or tuple(d.shape) != (N, K // int4.GROUP) or not torch.equal(d.half().float(), d.float()):
        raise HalError(f"weight: expected Q8_0 codes [N, K] (N a multiple of 16, K of 32) with fp16 scales "
                       f"[N, K/32], got {list(q.shape)} and {list(d.shape)}", arg="weight")
    NT, G = N // TILE, K // int4.GROUP
    u = (q.to(torch.int16) + 128).to(torch.uint8).view(NT, TILE, G, 8, 4)   # k = 32g + 4s + j
    codes = u.permute(0, 2, 3, 1, 4).reshape(NT, G, 512)
    return Q4Weight(huge_pages.resident(torch.cat([codes, _lanes([d])], -1).contiguous()), (N, K), True, dtype)


def quantize_q8(w: Tensor, dtype: torch.dtype) -> Q4Weight:
    """Q8 tiles of a float weight ``w`` [N, K], quantized as GGUF's Q8_0 is (per 32 inputs:
    ``d = max|w| / 127`` as fp16, ``q = round(w / d)``): a drafter's linear weights under a q4q8
    plan. A weight that was dequantized from Q8_0 gets its stored codes back."""
    N, K = w.shape
    if not int4.fits(N, K):
        raise HalError(f"weight: expected [N, K] with N a multiple of 16 and K of 32, got {list(w.shape)}",
                       arg="weight")
    v = w.detach().float().cpu().view(N, K // int4.GROUP, int4.GROUP)
    d = (v.abs().amax(-1) / 127).half().float()
    q = torch.round(v / torch.where(d > 0, d, 1.0)[..., None]).clamp(-128, 127).to(torch.int8)
    return pack_q8(q.view(N, K), d, dtype)


@dataclass(frozen=True)
class Q8Blocks:
    """A GGUF Q8_0 tensor as stored, unpacked: ``w = q·d`` per 32 inputs (a layer's part, kept
    so until its fused linear is packed: `cat`, then `pack_q8`)."""

    q: Tensor   # int8 [N, K]
    d: Tensor   # float32 [N, K/32], fp16 values

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @staticmethod
    def cat(parts: list["Q8Blocks"]) -> "Q8Blocks":
        return Q8Blocks(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]))

    def pack(self, dtype: torch.dtype) -> Q4Weight:
        return pack_q8(self.q, self.d, dtype)


def q8_0_blocks(raw: np.ndarray, shape: tuple[int, int]) -> Q8Blocks:
    """A GGUF Q8_0 tensor's bytes ``raw`` (logical ``shape`` [N, K]) as `Q8Blocks`."""
    N, K = shape
    if K % int4.GROUP or raw.size != N * K // int4.GROUP * int4.Q8_BYTES:
        raise HalError(f"raw: expected {N * K // int4.GROUP * int4.Q8_BYTES} bytes for Q8_0 [{N}, {K}], "
                       f"got {raw.size}", arg="raw")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // int4.GROUP, int4.Q8_BYTES)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if not torch.isfinite(d).all():
        raise HalError(f"raw: expected finite fp16 scales in every Q8_0 block, got {d[~torch.isfinite(d)][0]}", arg="raw")
    return Q8Blocks(torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(N, K)), d)


def pack_q6k(q: Tensor, d: Tensor, sc: Tensor, dtype: torch.dtype) -> Q4Weight:
    """Q6 tiles of codes ``q`` [N, K] in -32..31 with w = d·sc·q: ``d`` [N, K/32] fp16 values, ``sc``
    [N, K/16] int8 (Q6_K's super-block d, given per group, so the same for each 8 groups, and its
    scale per 16)."""
    N, K = q.shape
    if not int4.fits(N, K) or K % 256 or tuple(d.shape) != (N, K // 32) or tuple(sc.shape) != (N, K // 16) \
            or q.dtype != torch.int8 or sc.dtype != torch.int8 or not torch.equal(d.half().float(), d.float()) \
            or not _per_super(d) or bool(((q < -32) | (q > 31)).any()):
        raise HalError(f"weight: expected Q6_K codes [N, K] int8 in -32..31 (N a multiple of 16, K of 256), fp16 d "
                       f"[N, K/32] the same across each super-block's 8 groups and int8 scales [N, K/16], got "
                       f"{q.dtype} {list(q.shape)}, {list(d.shape)} and {sc.dtype} {list(sc.shape)}", arg="weight")
    NT, G = N // TILE, K // int4.GROUP
    u = (q.to(torch.int16) + 32).to(torch.uint8).view(NT, TILE, G, 8, 4)   # k = 32g + 4s + j
    u = u.permute(0, 2, 3, 1, 4).reshape(NT, G, 8, 64)   # per step s, the Q8 tile's byte order
    nib = (u[:, :, 0::2] & 15) | ((u[:, :, 1::2] & 15) << 4)                 # blocks p: steps 2p, 2p + 1
    hi = (u >> 4).view(NT, G, 2, 4, 64)
    top = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)   # blocks h
    scb = sc.view(NT, TILE, G, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(NT, G, 32)
    groups = torch.cat([nib.reshape(NT, G, 256), top.reshape(NT, G, 128), scb], -1)
    head = _super_heads([d])   # [NT, G/8, 32]
    packed = torch.cat([head, groups.reshape(NT, G // SUPER, -1)], -1).contiguous()
    return Q4Weight(huge_pages.resident(packed), (N, K), False, dtype, q6k=True)


def _per_super(d: Tensor) -> bool:
    """Whether ``d`` [N, K/32] is the same across each super-block's 8 groups."""
    v = d.reshape(d.shape[0], -1, SUPER)
    return torch.equal(v, v[..., :1].expand_as(v))


def _super_heads(values: list[Tensor]) -> Tensor:
    """The tiles' super-block heads: `_lanes` of ``values`` ([N, K/32], one value per super-block,
    given per group) taken once per super-block: uint8 [N/16, K/256, 32·len]."""
    return _lanes([x.reshape(x.shape[0], -1, SUPER)[..., 0] for x in values])


def _lanes(values: list[Tensor]) -> Tensor:
    """Per-output fp16 values as the tiles keep them: for each of ``values`` ([N, n], fp16 values),
    per (tile, column) its 16 outputs' values in lane order, one value after another: uint8
    [N/16, n, 32·len(values)]."""
    N, n = values[0].shape
    v = torch.stack([x.half().view(N // TILE, TILE, n) for x in values], 2)   # [NT, 16, len, n]
    return v.permute(0, 3, 2, 1).contiguous().view(torch.uint8).reshape(N // TILE, n, 32 * len(values))


def pack_q4k(codes: Tensor, d: Tensor, dmin: Tensor, sc: Tensor, mn: Tensor, dtype: torch.dtype,
             q5: bool = False) -> Q4Weight:
    """Q4K tiles of Q4_K codes [N, K] (0..15) with, per 32 inputs [N, K/32], the super-block's
    fp16 ``d`` and ``dmin`` and the sub-block's 6-bit ``sc`` and ``mn``: w = d·sc·q − dmin·mn;
    with ``q5``, Q5K tiles of Q5_K's codes (0..31), their fifth bits after."""
    N, K = codes.shape
    G, NT = K // int4.GROUP, N // TILE
    if not int4.fits(N, K) or K % 256 or any(tuple(t.shape) != (N, G) for t in (d, dmin, sc, mn)) \
            or not (torch.equal(d.half().float(), d.float()) and torch.equal(dmin.half().float(), dmin.float())) \
            or not (_per_super(d) and _per_super(dmin)) or int(codes.min()) < 0 or int(codes.max()) > (31 if q5 else 15):
        raise HalError(f"weight: expected Q{5 if q5 else 4}_K codes [N, K] in 0..{31 if q5 else 15} (K a multiple of "
                       f"256) with fp16 d, dmin (the same across each super-block's 8 groups) and scales, mins "
                       f"[N, K/32], got {list(codes.shape)}, {list(d.shape)}", arg="weight")
    c = codes.to(torch.uint8).view(NT, TILE, G, 4, 2, 4)   # as `pack`'s Q4 codes
    packed = ((c[..., 0, :] & 15) | ((c[..., 1, :] & 15) << 4)).permute(0, 2, 3, 1, 4).reshape(NT, G, 256)
    smn = torch.stack([sc.to(torch.uint8).view(NT, TILE, G), mn.to(torch.uint8).view(NT, TILE, G)], 2)
    smn = smn.permute(0, 3, 2, 1).reshape(NT, G, 32)
    groups = torch.cat([packed, smn] + ([_fifth_bits(c)] if q5 else []), -1).reshape(NT, G // SUPER, -1)
    head = _super_heads([d, -dmin])   # [NT, G/8, 64]
    packed = huge_pages.resident(torch.cat([head, groups], -1).contiguous())
    return Q4Weight(packed, (N, K), False, dtype, q4k=True, q5=q5)


def pack_q5(codes: Tensor, d: Tensor, dtype: torch.dtype) -> Q4Weight:
    """Q5 tiles of Q5_0 codes [N, K] (0..31) with fp16 ``d`` per 32 inputs [N, K/32]: w =
    d·(q − 16), a Q4 tile of the low 4 bits without m (the kernel forms m = d·(−16), exact in float32)
    and the fifth bits."""
    N, K = codes.shape
    G, NT = K // int4.GROUP, N // TILE
    if not int4.fits(N, K) or tuple(d.shape) != (N, G) or codes.dtype not in (torch.uint8, torch.int16, torch.int32,
                                                                              torch.int64) \
            or int(codes.min()) < 0 or int(codes.max()) > 31 or not torch.equal(d.half().float(), d.float()):
        raise HalError(f"weight: expected Q5_0 codes [N, K] in 0..31 with fp16 d [N, K/32], "
                       f"got {codes.dtype} {list(codes.shape)}, d {list(d.shape)}", arg="weight")
    c = codes.to(torch.uint8).view(NT, TILE, G, 4, 2, 4)   # k = 32g + 8s + 4·nibble + j, as `pack`'s
    packed = ((c[..., 0, :] & 15) | ((c[..., 1, :] & 15) << 4)).permute(0, 2, 3, 1, 4).reshape(NT, G, 256)
    packed = huge_pages.resident(torch.cat([packed, _lanes([d]), _fifth_bits(c)], -1).contiguous())
    return Q4Weight(packed, (N, K), False, dtype, q5=True)


def _fifth_bits(c: Tensor) -> Tensor:
    """The 64 bytes per (tile, group) of 5-bit codes' fifth bits (``c`` uint8 [NT, 16, G, s, nibble,
    j] in `pack`'s order): bit 2s + nibble of byte 4·lane + j."""
    NT, _, G = c.shape[:3]
    shift = (2 * torch.arange(4).view(4, 1, 1) + torch.arange(2).view(1, 2, 1)).to(torch.uint8)
    bits = ((c >> 4) << shift).sum((3, 4), dtype=torch.uint8)   # [NT, 16, G, j]
    return bits.permute(0, 2, 1, 3).reshape(NT, G, 64)


def random_q5(N: int, K: int, generator: torch.Generator, dtype: torch.dtype) -> Q4Weight:
    """Random Q5 tiles (tests and timing)."""
    d = (torch.rand(N, K // int4.GROUP, generator=generator) * 1e-3 + 1e-5).half().float()
    return pack_q5(torch.randint(0, 32, (N, K), generator=generator, dtype=torch.uint8), d, dtype)


def random_q4k(N: int, K: int, generator: torch.Generator, dtype: torch.dtype, q5: bool = False) -> Q4Weight:
    """Random Q4K (``q5``: Q5K) tiles (a plan's self-check and timing)."""
    G = K // int4.GROUP
    d, dmin = ((torch.rand(N, G // SUPER, generator=generator) * 1e-3 + 1e-5).half().float().repeat_interleave(SUPER, 1)
               for _ in range(2))
    sc, mn = (torch.randint(0, 64, (N, G), generator=generator, dtype=torch.uint8) for _ in range(2))
    q = torch.randint(0, 32 if q5 else 16, (N, K), generator=generator, dtype=torch.uint8)
    return pack_q4k(q, d, dmin, sc, mn, dtype, q5)


def q6_scales(d: Tensor, sc: Tensor) -> Tensor:
    """The scale per 16 inputs, d·sc [N, K/16] (an exact float32 product)."""
    return d.float().repeat_interleave(2, 1) * sc.float()


def random_q6k(N: int, K: int, generator: torch.Generator, dtype: torch.dtype) -> Q4Weight:
    """Random Q6 tiles (a plan's self-check and timing)."""
    q = torch.randint(-32, 32, (N, K), generator=generator, dtype=torch.int16).to(torch.int8)
    d = (torch.rand(N, K // 256, generator=generator) * 1e-4 + 1e-5).half().float().repeat_interleave(SUPER, 1)
    sc = torch.randint(-128, 128, (N, K // 16), generator=generator, dtype=torch.int16).to(torch.int8)
    return pack_q6k(q, d, sc, dtype)


def from_q8_0(raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> Q4Weight:
    """Q8 tiles of a GGUF Q8_0 tensor's bytes ``raw`` (logical ``shape`` [N, K])."""
    return q8_0_blocks(raw, shape).pack(dtype)


def random(N: int, K: int, generator: torch.Generator) -> int4.Int4Blocks:
    """Random int4 blocks whose scales and mins are fp16 values (a plan's self-check and timing)."""
    b = int4.random(N, K, generator)
    d, m = b.scales.half().float(), (b.zeros - 8 * b.scales).half().float()
    return int4.Int4Blocks(b.codes, d, m + 8 * d)


def random_q8(N: int, K: int, generator: torch.Generator, dtype: torch.dtype) -> Q4Weight:
    """Random Q8 tiles with small fp16 scales."""
    q = torch.randint(-128, 128, (N, K), generator=generator, dtype=torch.int16).to(torch.int8)
    d = (torch.rand(N, K // int4.GROUP, generator=generator) * 1e-3 + 1e-4).half().float()
    return pack_q8(q, d, dtype)


def build(compiler: str | None = None) -> Path:
    """The compiled kernel library for this CPU and this torch (compiled when not cached)."""
    from hal.models import row_kernels
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    flags, libs = native.torch_flags(row_kernels.flags())
    return native.compile_library("q4q8 kernel", [SOURCE, KERNEL, Q8_TILES], cxx, flags, libs)


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def available() -> bool:
    """Whether the kernel builds and loads here (a plan measures ``q4q8`` only then)."""
    with _lock:
        if "lib" not in _loaded:
            try:
                lib = ctypes.CDLL(str(build()))
                lib.q4_mm.argtypes, lib.q4_mm.restype = [_P, _I, _I, _I, _I, _P, _I, _I, _I, _P], _I
                _loaded["lib"] = lib
            except (HalError, OSError) as e:
                warnings.warn(f"spec-hal: the q4q8 kernel did not build, so plans run int4 weights on int4pack: {e}",
                              RuntimeWarning, stacklevel=2)
                _loaded["lib"] = None
        return _loaded["lib"] is not None


def library() -> ctypes.CDLL:
    lib = _loaded.get("lib")   # loaded: no lock on the hot path (each product calls this)
    if lib is not None:
        return lib
    if not available():
        raise HalError("weight: expected the q4q8 kernel to build here for a q4q8 weight, got none (see the "
                       "warning)", arg="weight")
    return _loaded["lib"]

