"""GGUF K-quant tensors as stored (ggml-quants.c's layouts; `gguf`'s dequantization is the
oracle in tests/models/test_q4_rows.py and test_q6_k.py), unpacked into their codes and scales
until a fused linear packs them into the q4q8 kernel's tiles (`hal.models.q4_rows`): Q6_K into
Q6 tiles, Q4_K into Q4K tiles, Q5_K into Q5K tiles, Q5_0 (what a Q4_K_M file keeps where a row is not a multiple of
256) into Q5 tiles. A fused linear whose parts differ in type (a Q4_K_M file's q and
k in Q4_K, its v in Q6_K) is a `MixedWeight`: each run of parts of one type packed on its own,
their outputs side by side (each row's bits are its part's: batch-invariant as every tile); the
native layer loop runs one of two parts (`hal.models.layer_loop.LayerWeights.rows1`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from hal.errors import HalError
from hal.models import q4_rows

Q6K_BYTES, Q4K_BLOCK, Q5K_BLOCK = 210, 144, 176   # a GGUF block of 256 weights: Q6_K, Q4_K, Q5_K
Q5_0_BLOCK = 22                    # a GGUF Q5_0 block of 32 weights: fp16 d, 4 bytes of fifth bits, 16 of nibbles


def _blocks(raw: np.ndarray, shape: tuple[int, int], kind: str, per: int, nbytes: int) -> np.ndarray:
    """A tensor's bytes as its blocks [N·K/per, nbytes] (``per`` weights each), or a `HalError`
    naming ``raw`` when their count is not the logical ``shape``'s."""
    N, K = shape
    if K % per or raw.size != N * K // per * nbytes:
        raise HalError(f"raw: expected {N * K // per * nbytes} bytes for {kind} [{N}, {K}], got {raw.size}", arg="raw")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)


def _finite(name: str, *scales: np.ndarray) -> None:
    """`HalError` naming ``raw`` where a block's fp16 scale is NaN or infinite (its weights would be)."""
    for a in scales:
        if not np.isfinite(a).all():
            i = int(np.flatnonzero(~np.isfinite(a.reshape(-1)))[0])
            raise HalError(f"raw: expected finite fp16 scales in every {name} block, got {a.reshape(-1)[i]} at block "
                           f"{i}", arg="raw")


class _Rows:
    """Codes and scales by output row: `cat` joins parts' rows (a fused linear's), field by field."""

    @classmethod
    def cat(cls, parts: list) -> "_Rows":
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))


@dataclass(frozen=True)
class Q6Codes(_Rows):
    """A GGUF Q6_K tensor as stored, unpacked (`q6_k_codes`): ``w = s·q`` per 16 inputs (a layer's
    part, kept so until its fused linear is packed: `cat`, then `pack_q6k`)."""

    q: Tensor    # int8 [N, K] in -32..31
    d: Tensor    # float32 [N, K/32], fp16 values (the super-block's d, per group)
    sc: Tensor   # int8 [N, K/16]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def pack(self, dtype: torch.dtype) -> q4_rows.Q4Weight:
        return q4_rows.pack_q6k(self.q, self.d, self.sc, dtype)


def q6_k_codes(raw: np.ndarray, shape: tuple[int, int]) -> Q6Codes:
    """A GGUF Q6_K tensor's bytes ``raw`` (logical ``shape`` [N, K], K a multiple of 256) as
    `Q6Codes`: w = d·sc·q (`q6_scales`). ggml's
    layout (ggml-quants.c, dequantize_row_q6_K): per 128 weights, 64 bytes of low nibbles and 32
    of high bit pairs; weight l + 32i (i = 0..3) of the 128 takes the low nibble of byte l (i
    even) or l + 32 (i odd), shifted right by 4 for i >= 2, and bits 2i..2i+1 of its pair byte."""
    N, K = shape
    b = _blocks(raw, shape, "Q6_K", 256, Q6K_BYTES)
    ql, qh = b[:, :128].reshape(-1, 2, 64).astype(np.int16), b[:, 128:192].reshape(-1, 2, 1, 32).astype(np.int16)
    low = np.stack([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.int16).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)) - 32).astype(np.int8).reshape(N, K)
    sc = torch.from_numpy(b[:, 192:208].copy().view(np.int8).reshape(N, K // 16))
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    _finite("Q6_K", d)
    d = torch.from_numpy(d).view(N, K // 256)
    return Q6Codes(torch.from_numpy(q), d.repeat_interleave(8, 1), sc)


def from_q6_k(raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> q4_rows.Q4Weight:
    """Q6 tiles of a GGUF Q6_K tensor's bytes ``raw`` (logical ``shape`` [N, K])."""
    return q6_k_codes(raw, shape).pack(dtype)


@dataclass(frozen=True)
class Q4KCodes(_Rows):
    """A GGUF Q4_K tensor as stored, unpacked (`q4_k_codes`): w = d·sc·q − dmin·mn per 32 inputs."""

    q: Tensor      # uint8 [N, K] in 0..15
    d: Tensor      # float32 [N, K/32], fp16 values (the super-block's, per group)
    dmin: Tensor   # float32 [N, K/32], fp16 values
    sc: Tensor     # uint8 [N, K/32] in 0..63
    mn: Tensor     # uint8 [N, K/32] in 0..63

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def pack(self, dtype: torch.dtype) -> q4_rows.Q4Weight:
        return q4_rows.pack_q4k(self.q, self.d, self.dmin, self.sc, self.mn, dtype)


class Q5KCodes(Q4KCodes):
    """A GGUF Q5_K tensor as stored (`q5_k_codes`): Q4_K's arithmetic with codes q in 0..31."""

    def pack(self, dtype: torch.dtype) -> q4_rows.Q4Weight:
        return q4_rows.pack_q4k(self.q, self.d, self.dmin, self.sc, self.mn, dtype, q5=True)


def q5_k_codes(raw: np.ndarray, shape: tuple[int, int]) -> Q5KCodes:
    """A GGUF Q5_K tensor's bytes ``raw`` (logical ``shape`` [N, K], K a multiple of 256). ggml's
    layout (block_q5_K, dequantize_row_q5_K): Q4_K's d, dmin and 12 bytes of scales and mins,
    then 32 bytes qh and 128 bytes of nibbles as Q4_K's; the code of weight l of the 32 low
    (high) nibbles of 64-chunk c takes bit 2c (2c + 1) of qh[l] as its fifth bit."""
    N, K = shape
    b = _blocks(raw, shape, "Q5_K", 256, Q5K_BLOCK)
    four = q4_k_codes(np.concatenate([b[:, :16], b[:, 48:]], 1).reshape(-1), shape)   # Q4_K's fields
    qh = b[:, 16:48].astype(np.uint8)[:, None, None, :]                                 # [blocks, 1, 1, 32]
    shift = (2 * np.arange(4).reshape(4, 1, 1) + np.arange(2).reshape(1, 2, 1)).astype(np.uint8)
    top = ((qh >> shift) & 1).reshape(N, K)            # per 64: the 32 low nibbles' bits, then the high's
    return Q5KCodes(four.q | torch.from_numpy(top << 4), four.d, four.dmin, four.sc, four.mn)


def q4_k_codes(raw: np.ndarray, shape: tuple[int, int]) -> Q4KCodes:
    """A GGUF Q4_K tensor's bytes ``raw`` (logical ``shape`` [N, K], K a multiple of 256). ggml's
    layout (block_q4_K, dequantize_row_q4_K): fp16 d and dmin, 12 bytes of 6-bit scales and
    mins (get_scale_min_k4), then 128 bytes: per 64 weights, 32 bytes whose low nibbles are the
    first 32 and high nibbles the next 32."""
    N, K = shape
    b = _blocks(raw, shape, "Q4_K", 256, Q4K_BLOCK)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    _finite("Q4_K", d, dmin)
    s = b[:, 4:16].astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], 2).reshape(N, K)   # per 64: 32 low nibbles, then 32 high
    per_group = lambda a: torch.from_numpy(np.ascontiguousarray(a)).reshape(N, K // 32)  # noqa: E731
    return Q4KCodes(torch.from_numpy(q.astype(np.uint8)), per_group(np.repeat(d, 8, 1)),
                    per_group(np.repeat(dmin, 8, 1)), per_group(sc.astype(np.uint8)), per_group(mn.astype(np.uint8)))


@dataclass(frozen=True)
class Q5Codes(_Rows):
    """A GGUF Q5_0 tensor as stored, unpacked (`q5_0_codes`): w = d·(q − 16) per 32 inputs."""

    q: Tensor    # uint8 [N, K] in 0..31
    d: Tensor    # float32 [N, K/32], fp16 values

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def pack(self, dtype: torch.dtype) -> q4_rows.Q4Weight:
        return q4_rows.pack_q5(self.q, self.d, dtype)


def q5_0_codes(raw: np.ndarray, shape: tuple[int, int]) -> Q5Codes:
    """A GGUF Q5_0 tensor's bytes ``raw`` (logical ``shape`` [N, K], K a multiple of 32). ggml's
    layout (block_q5_0, dequantize_row_q5_0): fp16 d, a little-endian uint32 qh, 16 bytes qs;
    weight j < 16 is qs[j]'s low nibble with bit j of qh, weight j + 16 its high nibble with bit
    j + 16."""
    N, K = shape
    b = _blocks(raw, shape, "Q5_0", 32, Q5_0_BLOCK)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    _finite("Q5_0", d)
    qh = b[:, 2:6].copy().view("<u4").astype(np.int64)                  # [blocks, 1]
    qs = b[:, 6:].astype(np.int64)
    low = np.concatenate([qs & 15, qs >> 4], 1)                         # [blocks, 32]
    high = (qh >> np.arange(32, dtype=np.int64)) & 1
    q = (low | (high << 4)).astype(np.uint8).reshape(N, K)
    return Q5Codes(torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d)).reshape(N, K // 32))


CODES = (q4_rows.Q8Blocks, Q4KCodes, Q6Codes, Q5Codes)   # a part as loaded, packed by `pack_parts`
READERS = {"Q6_K": (q6_k_codes, "Q6"), "Q4_K": (q4_k_codes, "Q4K"), "Q5_0": (q5_0_codes, "Q5"),
           "Q5_K": (q5_k_codes, "Q5K"),
           "Q8_0": (q4_rows.q8_0_blocks, "Q8")}   # a GGUF type -> (its bytes as codes, the tiles they run in)


@dataclass(eq=False)
class MixedWeight:
    """A fused linear ``[N, K]`` whose parts run in different tiles (`pack_parts`)."""

    parts: tuple[q4_rows.Q4Weight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def codes(self) -> int:
        return self.parts[0].codes   # every part's (`with_codes`)

    def with_codes(self, codes: int) -> "MixedWeight":
        return MixedWeight(tuple(p.with_codes(codes) for p in self.parts))

    def mm(self, x: Tensor) -> Tensor:
        return torch.cat([p.mm(x) for p in self.parts], 1)

    def to(self, device) -> "MixedWeight":
        return MixedWeight(tuple(p.to(device) for p in self.parts))


def pack_parts(parts: list, dtype: torch.dtype):
    """The fused linear of ``parts`` (each one of `CODES`, in output order): one weight
    where they share a type, else a `MixedWeight` of each run of one type."""
    runs: list[list] = []
    for p in parts:
        if runs and type(runs[-1][0]) is type(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    packed = [type(run[0]).cat(run).pack(dtype) for run in runs]
    return packed[0] if len(packed) == 1 else MixedWeight(tuple(packed))
