"""int4 weights as a GGUF file stores them, multiplied by PyTorch's int4pack kernel
(``aten._weight_int4pack_mm_for_cpu``), with no float copy.

Glossary:

- **Q4_1 block**: 32 weights of one row in 20 bytes: fp16 ``d``, fp16 ``m``, then 16 bytes
  of 4-bit codes ``q`` (low nibbles are weights 0..15, high nibbles 16..31); ``w = d·q + m``.
- **Q4_0 block**: 18 bytes, fp16 ``d`` then the codes; ``w = d·(q - 8)``.
- **int4pack, group 32**: codes ``q`` in 0..15 with a scale and a zero per 32 weights of a
  row; the kernel computes ``w = (q - 8)·scale + zero``. So a Q4_1 block is exactly
  ``scale = d``, ``zero = m + 8d``, and a Q4_0 block ``scale = d``, ``zero = 0``: the
  codes are used as stored.
- **Q8_0 block** (the tied embedding and lm_head of SmolLM2's file): 34 bytes, fp16 ``d`` then
  32 int8 codes ``q``; ``w = d·q``. It runs on the same kernel as **two int4 halves** along K:
  ``q = 16·hi + lo`` with ``lo = q & 15`` (0..15) and ``hi`` in -8..7, so the weight
  ``[N, 2K]`` of codes ``[hi + 8 | lo]``, scales ``[16d | d]`` and zeros ``[0 | 8d]``
  multiplied by the row ``[x | x]`` is ``x @ W.T`` exactly (``16d`` and ``8d`` are ``d``
  times a power of two: in bfloat16 they round as ``d`` does).
- **Activation dtype**: the kernel multiplies rows of that dtype and takes its scales and
  zeros in it. With bfloat16 the fp16 ``d`` and ``m`` round to bfloat16 (about as much as
  a bfloat16 copy of the dequantized weights would); with float32 they are exact, but the
  CPU kernel has no fast float32 path.

Shapes: a weight is ``[N, K]`` (N outputs, K inputs, K a multiple of 32); G = K / 32 groups."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hal.errors import HalError

GROUP = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}   # bytes per 32 weights, by GGUF block type
Q8_BYTES = 34                              # a Q8_0 block: fp16 d, 32 int8 codes


def fits(N: int, K: int) -> bool:
    """The kernel's shapes: N a multiple of 16 (its packing), K of the group size."""
    return N > 0 and K > 0 and N % 16 == 0 and K % GROUP == 0


@dataclass(eq=False)
class Int4Blocks:
    """A weight's stored form, unpacked: codes ``[N, K]`` (0..15), ``scales`` and ``zeros``
    ``[N, G]`` (float32, exact from the file). Fused projections are stacked in this form,
    then packed once."""

    codes: Tensor
    scales: Tensor
    zeros: Tensor
    mins: Tensor | None = None   # [N, G] float32: Q4_1's stored m (w = d·q + m), kept as read; None: zeros - 8·scales

    def __post_init__(self):
        N, K = self.codes.shape
        if not fits(N, K) or self.scales.shape != (N, K // GROUP) or self.zeros.shape != self.scales.shape:
            raise HalError(f"weight: expected int4 codes [N, K] with N a multiple of 16, K of {GROUP}, and scales/zeros "
                           f"[N, K/{GROUP}], got codes {list(self.codes.shape)}, scales {list(self.scales.shape)}, "
                           f"zeros {list(self.zeros.shape)}", arg="weight")

    def dequantize(self) -> Tensor:
        """float32 ``[N, K]``: ``(q - 8)·scale + zero`` per group."""
        N, K = self.codes.shape
        q = self.codes.view(N, K // GROUP, GROUP).float() - 8
        return (q * self.scales[..., None] + self.zeros[..., None]).reshape(N, K)

    def pack(self, dtype: torch.dtype, repeat: int = 1) -> "Int4Weight":
        """The kernel's form, scales and zeros in the activation ``dtype``. ``repeat``: the
        codes are that many stacked parts along K of one logical weight ``[N, K / repeat]``
        (Q8_0's two halves), each multiplied by the same row."""
        N, K = self.codes.shape
        if repeat < 1 or K % (repeat * GROUP):
            raise HalError(f"repeat: expected a count of parts of {GROUP}-multiples dividing K={K}, got {repeat}",
                           arg="repeat")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes.to(torch.int32).contiguous(), 1)
        sz = torch.stack([self.scales.T, self.zeros.T], -1).to(dtype).contiguous()
        return Int4Weight(packed, sz, (N, K // repeat), repeat)


@dataclass(eq=False)
class Int4Weight:
    """A linear weight ``[N, K]`` held as packed int4 codes plus a scale and a zero per group."""

    packed: Tensor        # the kernel's packing of the codes (``_convert_weight_to_int4pack_for_cpu``)
    scales_zeros: Tensor  # [G, N, 2] in the activation dtype: (scale, zero) per group and output
    shape: tuple[int, int]   # the logical [N, K]: what ``mm`` multiplies a row [K] by
    repeat: int = 1          # the packed codes are [N, K * repeat]: parts along K, each times the same row

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the kernel multiplies in (rows are cast to it)."""
        return self.scales_zeros.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def mm(self, x: Tensor) -> Tensor:
        """``x @ W.T`` for ``x`` [M, K] in `dtype`; [M, N] in `dtype`."""
        if self.repeat > 1:
            x = x.repeat(1, self.repeat)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def to(self, device) -> "Int4Weight":
        if torch.device(device).type != "cpu":
            raise HalError(f"device: expected cpu for an int4 weight (the int4pack kernel here is the CPU one), "
                           f"got {device}", arg="device")
        return self


def from_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Blocks:
    """The stored form of a GGUF tensor: bytes ``raw`` of block type ``kind`` (Q4_0 or
    Q4_1), logical ``shape`` ``[N, K]``."""
    if kind not in BLOCK_BYTES:
        raise HalError(f"kind: expected an int4 block type in {sorted(BLOCK_BYTES)}, got {kind!r}", arg="kind")
    N, K = shape
    size = BLOCK_BYTES[kind]
    if K % GROUP or raw.size != N * K // GROUP * size:
        raise HalError(f"raw: expected {N * K // GROUP * size} bytes for {kind} [{N}, {K}], "
                       f"got {raw.size}", arg="raw")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // GROUP, size)
    d = _half(blocks, 0)
    qs = blocks[..., size - 16:]
    codes = torch.from_numpy(np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(N, K))
    if kind == "Q4_1":   # w = d·q + m = d·(q - 8) + (m + 8d)
        m = _half(blocks, 2)
        return Int4Blocks(codes, d, m + 8 * d, m)
    return Int4Blocks(codes, d, torch.zeros_like(d))   # Q4_0: w = d·(q - 8)


def _half(blocks: np.ndarray, at: int) -> Tensor:
    """The fp16 field at byte ``at`` of every block (``[..., bytes]``), as float32 (exact)."""
    return torch.from_numpy(blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def from_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> Int4Blocks:
    """Q8_0 bytes ``raw`` of a logical ``[N, K]`` weight as its two int4 halves ``[N, 2K]``
    (see the glossary; `Int4Blocks.pack` with ``repeat=2`` multiplies them by ``[x | x]``)."""
    N, K = shape
    if K % GROUP or raw.size != N * K // GROUP * Q8_BYTES:
        raise HalError(f"raw: expected {N * K // GROUP * Q8_BYTES} bytes for Q8_0 [{N}, {K}], got {raw.size}",
                       arg="raw")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, K // GROUP, Q8_BYTES)
    d = _half(blocks, 0)
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(N, K)).to(torch.int16)
    return q8_halves(q, d)


def q8_halves(q: Tensor, d: Tensor) -> Int4Blocks:
    """int8 codes ``q`` [N, K] with a scale ``d`` [N, K/32] per block as two int4 halves ``[N, 2K]``."""
    lo = q & 15
    hi = (q - lo) // 16                                   # -8..7: q = 16·hi + lo exactly
    codes = torch.cat([hi + 8, lo], 1).to(torch.uint8)
    return Int4Blocks(codes, torch.cat([16 * d, d], 1), torch.cat([torch.zeros_like(d), 8 * d], 1))


def random_q8(N: int, K: int, generator: torch.Generator) -> Int4Blocks:
    """Random Q8_0 codes with small scales, as two int4 halves (a plan's self-check and timing)."""
    q = torch.randint(-128, 128, (N, K), generator=generator).to(torch.int16)
    return q8_halves(q, torch.rand(N, K // GROUP, generator=generator) * 1e-3 + 1e-4)


def cat(parts: list[Int4Blocks]) -> Int4Blocks:
    """Weights stacked along N (a fused qkv or gate-up projection)."""
    mins = None if any(p.mins is None for p in parts) else torch.cat([p.mins for p in parts])
    return Int4Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.zeros for p in parts]), mins)


def random(N: int, K: int, generator: torch.Generator) -> Int4Blocks:
    """Random codes with small scales (a plan's self-check and timing)."""
    codes = torch.randint(0, 16, (N, K), generator=generator).to(torch.uint8)
    scales = torch.rand(N, K // GROUP, generator=generator) * 0.01 + 0.001
    return Int4Blocks(codes, scales, torch.randn(N, K // GROUP, generator=generator) * 0.01)
