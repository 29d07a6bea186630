"""The q4q8 kernel (`hal.models.q4_rows`): stored int4 (Q4_0/Q4_1) and Q8_0 weights times rows
quantized to int8 per 32.

- Its products are `reference_mm`'s arithmetic bit for bit (torch, step by step), for Q4 and
  Q8 tiles, float32 and bfloat16 rows, 1 to 17 rows (every register-block size and a tail).
- A row's bits never depend on its batch-mates, their order or the thread count, and the
  AVX2 and plain C builds give the AVX-512 build's bits (the integer sums are exact; the
  float steps are the same on every path).
- Against the float product of the dequantized weights, every output is within the bound
  the row quantization allows: half a unit (each group's max / 127 / 128) per input, times
  the weights' magnitudes, plus 1e-5 relative for float32 rounding.
- GGUF bytes load into tiles exactly (the gguf package's dequantization is the oracle).
- Bad input gets a `HalError` naming the argument; a failing C++ compiler leaves plans
  without the form, with a warning; a planted kernel whose rows mix is never chosen."""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from hal.errors import HalError
from hal.models import int4, k_quants, plan_check, q4_reference, q4_rows
from hal.models.linear_layout import LinearPlan
from hal.models.linear_plan import choose_plan
from hal.models.machine import cpu_flags
from tests.models.compilers import plant_failing_compiler

pytestmark = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")),
                                reason="no C++ compiler: plans run without the q4q8 form (tested below)")
ROWS = [torch.float32, torch.bfloat16]


def q4_case(N: int, K: int, seed: int):
    blocks = q4_rows.random(N, K, torch.Generator().manual_seed(seed))
    return blocks, (blocks.codes, blocks.scales, blocks.zeros - 8 * blocks.scales)


def q40_case(N: int, K: int, seed: int):
    """Int4 blocks of Q4_0 (w = d·(q − 8): m = −8·d), packed as Q40 tiles (m not stored)."""
    b = q4_rows.random(N, K, torch.Generator().manual_seed(seed))
    blocks = int4.Int4Blocks(b.codes, b.scales, torch.zeros_like(b.scales))
    return blocks, (blocks.codes, blocks.scales, -8 * blocks.scales)


def q8_case(N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int16).to(torch.int8)
    d = (torch.rand(N, K // 32, generator=g) * 1e-2 + 1e-4).half().float()
    return (q, d), (q, d, None)


def q6_case(N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (N, K), generator=g, dtype=torch.int16).to(torch.int8)
    d = (torch.rand(N, K // 256, generator=g) * 1e-3 + 1e-5).half().float().repeat_interleave(8, 1)   # per super-block
    sc = torch.randint(-128, 128, (N, K // 16), generator=g, dtype=torch.int16).to(torch.int8)
    return (q, d, sc), (q, q4_rows.q6_scales(d, sc), None)


def q4k_case(N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    d, dmin = ((torch.rand(N, K // 256, generator=g) * 1e-3 + 1e-5).half().float().repeat_interleave(8, 1)
               for _ in range(2))   # per super-block of 256 inputs, as a file keeps them
    sc, mn = (torch.randint(0, 64, (N, K // 32), generator=g, dtype=torch.uint8) for _ in range(2))
    return (q, d, dmin, sc, mn), (q, d * sc.float(), -dmin * mn.float())   # Q4_K's d*sc and -dmin*min: exact


def q5_case(N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (N, K), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, K // 32, generator=g) * 1e-3 + 1e-5).half().float()
    return (q, d), (q, d, -16 * d)   # Q5_0: w = d·(q − 16)


def dims(kind: str, K: int) -> int:
    """K for a kind: a K-quant's (Q6, Q4K, Q5K: super-blocks of 256) rounded up to a multiple of 256."""
    return -(-K // 256) * 256 if kind in ("q6", "q4k", "q5k") else K


def make(kind: str, N: int, K: int, dtype: torch.dtype, seed: int = 0):
    """(weight, reference args) of a random Q4, Q40, Q8, Q6, Q4K, Q5 or Q5K weight."""
    if kind == "q5k":
        (q, d, dmin, sc, mn), (_, d1, m1) = q4k_case(N, K, seed)
        q = q + 16 * torch.randint(0, 2, q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        return q4_rows.pack_q4k(q, d, dmin, sc, mn, dtype, q5=True), (q, d1, m1)
    if kind == "q5":
        args, ref = q5_case(N, K, seed)
        return q4_rows.pack_q5(*args, dtype), ref
    if kind == "q4k":
        args, ref = q4k_case(N, K, seed)
        return q4_rows.pack_q4k(*args, dtype), ref
    if kind in ("q4", "q40"):
        blocks, ref = (q4_case if kind == "q4" else q40_case)(N, K, seed)
        w = q4_rows.pack(blocks, dtype)
        assert w.kind == (q4_rows.Q4_KIND if kind == "q4" else q4_rows.Q40_KIND)
        return w, ref
    if kind == "q6":
        (q, d, sc), ref = q6_case(N, K, seed)
        return q4_rows.pack_q6k(q, d, sc, dtype), ref
    (q, d), ref = q8_case(N, K, seed)
    return q4_rows.pack_q8(q, d, dtype), ref


def rows(T: int, K: int, seed: int) -> torch.Tensor:
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed))
    if T > 2:
        x[1] = 0            # a row of zeros (amax 0 in every group)
        x[2, :32] *= 1e4    # groups of very different scales in one row
    return x


@pytest.mark.parametrize("codes", q4_rows.CODES, ids=["one-code", "two-codes"])
@pytest.mark.parametrize("kind", ["q4", "q40", "q8", "q6", "q4k", "q5", "q5k"])
@pytest.mark.parametrize("dtype", ROWS, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("T,N,K", [(1, 48, 64), (3, 960, 576), (8, 32, 1536), (9, 64, 96), (17, 48, 576),
                                   (40, 32, 256)])   # 40: five passes of 8 rows (AVX-512)
def test_products_are_the_reference_arithmetic_bit_for_bit(kind, dtype, T, N, K, codes):
    K = dims(kind, K)
    w, ref = make(kind, N, K, dtype)
    w = w.with_codes(codes)
    x = rows(T, K, seed=T)
    got = w.mm(x)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    assert torch.equal(got, q4_reference.reference_mm(x.to(dtype).float(), *ref, row_codes=codes))


def test_one_code_rows_are_two_code_rows_without_their_residual():
    """One code a row is the hi code alone: nearer llama.cpp's int8 rows than the two-code
    product, and farther from the float product (the bound below is the hi code's half step)."""
    N, K = 64, 512
    w, (codes, d, m) = make("q4k", N, K, torch.float32, seed=8)
    x = rows(5, K, seed=9)
    one, two = w.with_codes(1).mm(x), w.mm(x)
    dense = (codes.double().view(N, K // 32, 32) * d.double()[..., None] + m.double()[..., None]).reshape(N, K)
    exact = x.double() @ dense.T
    step = x.view(5, K // 32, 32).abs().amax(-1).double() / 127      # each group's hi step
    bound = 0.5 * torch.einsum("tg,ngk->tn", step, dense.abs().view(N, K // 32, 32)) \
        + 1e-5 * (x.double().abs() @ dense.abs().T)
    assert ((one.double() - exact).abs() <= bound).all()
    assert (one.double() - exact).abs().mean() > 4 * (two.double() - exact).abs().mean()
    assert w.with_codes(1).packed is w.packed and w.with_codes(1).codes == 1


@pytest.mark.parametrize("codes", q4_rows.CODES, ids=["one-code", "two-codes"])
@pytest.mark.parametrize("kind", ["q4", "q40", "q8", "q6", "q4k", "q5", "q5k"])
def test_a_row_never_depends_on_its_batch_mates_order_or_threads(kind, codes):
    w, _ = make(kind, 96, dims(kind, 576), torch.bfloat16, seed=1)
    w = w.with_codes(codes)
    x = rows(13, dims(kind, 576), seed=2)
    whole = w.mm(x)
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(0))
    assert torch.equal(w.mm(x[perm]), whole[perm])
    assert torch.equal(torch.cat([w.mm(x[i:i + 1]) for i in range(13)]), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(w.mm(x), whole)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(w.mm(x.T.contiguous().T), whole)   # any strides


def test_a_non_finite_input_makes_its_own_row_nan_only():
    w, _ = make("q4", 48, 64, torch.float32)
    x = rows(4, 64, seed=3)
    x[0, 5], x[3, 40] = float("inf"), float("nan")
    got = w.mm(x)
    assert got[0].isnan().all() and got[3].isnan().all() and got[1:3].isfinite().all()


@pytest.mark.parametrize("kind", ["q4", "q40", "q8", "q6", "q4k", "q5", "q5k"])
def test_products_stay_within_the_row_quantization_bound(kind):
    N, K = 64, dims(kind, 576)
    w, (codes, d, m) = make(kind, N, K, torch.float32, seed=4)
    x = rows(6, K, seed=5)
    per = K // d.shape[1]   # inputs per scale: 32, or Q6's 16
    dense = codes.double().view(N, K // per, per) * d.double()[..., None]
    if m is not None:
        dense = dense + m.double()[..., None]
    dense = dense.reshape(N, K)
    exact = x.double() @ dense.T
    step = x.view(6, K // 32, 32).abs().amax(-1).double() / 127 / 128      # each group's unit (lo's step)
    bound = 0.5 * torch.einsum("tg,ngk->tn", step, dense.abs().view(N, K // 32, 32)) \
        + 1e-5 * (x.double().abs() @ dense.abs().T)
    err = (w.mm(x).double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())
    assert float(err.max()) > 0   # it is quantized: the bound is not met by being the float product


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "plain-c"])
def test_other_code_paths_give_the_same_bits(monkeypatch, march):
    if march == "x86-64-v3" and "avx2" not in cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    monkeypatch.setenv("HAL_MARCH", march)
    lib = ctypes.CDLL(str(q4_rows.build()))
    lib.q4_mm.argtypes, lib.q4_mm.restype = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] + \
        [ctypes.c_int64] * 3 + [ctypes.c_void_p], ctypes.c_int64
    for kind, codes in itertools.product(("q4", "q40", "q8", "q6", "q4k", "q5", "q5k"), q4_rows.CODES):
        K = dims(kind, 576)
        w, _ = make(kind, 96, K, torch.bfloat16, seed=6)
        w = w.with_codes(codes)
        x = rows(21, K, seed=7).bfloat16()   # AVX2: 6 passes of 4 or 3 rows
        y = torch.empty(21, 96)
        assert lib.q4_mm(w.packed.data_ptr(), w.kind, codes, 96, K, x.data_ptr(), 1, 21, K, y.data_ptr()) == 0
        assert torch.equal(y, w.mm(x)), (kind, codes)


KINDS = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1,
         "Q8_0": gguf.GGMLQuantizationType.Q8_0}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gguf_bytes_load_into_tiles_exactly(kind):
    N, K = 48, 96
    raw = quants.quantize(np.random.default_rng(0).standard_normal((N, K)).astype(np.float32) * 0.05, KINDS[kind])
    dense = torch.from_numpy(quants.dequantize(raw, KINDS[kind]).reshape(N, K).copy())
    if kind == "Q8_0":
        w = q4_rows.from_q8_0(raw, (N, K), torch.float32)
        blocks = raw.reshape(N, K // 32, 34)
        d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(N, K))
        ref = (q, d, None)
        assert torch.equal((q.float().view(N, -1, 32) * d[..., None]).reshape(N, K), dense)
    else:
        b = int4.from_blocks(raw, kind, (N, K))
        w, ref = q4_rows.pack(b, torch.float32), (b.codes, b.scales, b.zeros - 8 * b.scales)
        assert torch.equal(b.dequantize(), dense)
        assert w.kind == (q4_rows.Q40_KIND if kind == "Q4_0" else q4_rows.Q4_KIND)   # Q4_0: m not stored
        assert w.nbytes == N * K // 32 * (18 if kind == "Q4_0" else 20)   # the file's bytes, no more
    x = rows(5, K, seed=8)
    assert torch.equal(w.mm(x), q4_reference.reference_mm(x, *ref))


def random_q6_k(N: int, K: int, seed: int) -> np.ndarray:
    """Random GGUF Q6_K blocks (every code and scale byte drawn, a finite fp16 d per block)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (N * K // 256, k_quants.Q6K_BYTES), dtype=np.uint8)
    b[:, 208:210] = (rng.random(N * K // 256) * 1e-3 + 1e-5).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def test_q6_k_bytes_load_into_tiles_as_gguf_dequantizes_them():
    """ggml's Q6_K layout read here gives, code times scale in float32, exactly the weights that
    gguf's own dequantization gives; the tiles' products are the reference arithmetic on them."""
    N, K = 48, 512
    raw = random_q6_k(N, K, seed=9)
    dense = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(N, K).copy())
    codes = k_quants.q6_k_codes(raw, (N, K))
    q, s = codes.q, q4_rows.q6_scales(codes.d, codes.sc)
    assert int(q.min()) == -32 and int(q.max()) == 31   # every code value drawn
    assert torch.equal((q.float().view(N, -1, 16) * s[..., None]).reshape(N, K), dense)
    w = k_quants.from_q6_k(raw, (N, K), torch.bfloat16)
    x = rows(5, K, seed=10)
    assert torch.equal(w.mm(x), q4_reference.reference_mm(x.bfloat16().float(), q, s, None))
    with pytest.raises(HalError, match="raw"):
        k_quants.q6_k_codes(raw[:-1], (N, K))


def random_q4_k(N: int, K: int, seed: int, kind: str = "Q4_K") -> np.ndarray:
    """Random GGUF Q4_K (or Q5_K) blocks (every code, fifth-bit and scale byte drawn, finite fp16
    d and dmin)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (N * K // 256, k_quants.Q4K_BLOCK if kind == "Q4_K" else k_quants.Q5K_BLOCK),
                     dtype=np.uint8)
    b[:, 0:4] = (rng.random((N * K // 256, 2)) * 1e-3 + 1e-5).astype(np.float16).view(np.uint8).reshape(-1, 4)
    return b.reshape(-1)


def random_q5_k(N: int, K: int, seed: int) -> np.ndarray:
    return random_q4_k(N, K, seed, "Q5_K")


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_q4_k_and_q5_k_bytes_load_into_tiles_as_gguf_dequantizes_them(kind):
    """ggml's Q4_K layout read here (6-bit scales and mins, nibbles per 64; Q5_K: qh's bit pairs
    too) gives, as d*sc*q - dmin*min in float32, exactly gguf's dequantization; the tiles'
    products are the reference arithmetic on them."""
    N, K = 48, 512
    raw = random_q4_k(N, K, 11, kind)
    dense = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(N, K).copy())
    c = (k_quants.q4_k_codes if kind == "Q4_K" else k_quants.q5_k_codes)(raw, (N, K))
    top = 15 if kind == "Q4_K" else 31
    assert int(c.sc.max()) == 63 and int(c.mn.max()) == 63 and int(c.q.max()) == top   # every bit drawn
    d1, m1 = c.d * c.sc.float(), c.dmin * c.mn.float()
    assert torch.equal((d1[..., None] * c.q.float().view(N, -1, 32) - m1[..., None]).reshape(N, K), dense)
    w = c.pack(torch.bfloat16)
    assert w.kind == (q4_rows.Q4K_KIND if kind == "Q4_K" else q4_rows.Q5K_KIND)
    x = rows(5, K, seed=12)
    assert torch.equal(w.mm(x), q4_reference.reference_mm(x.bfloat16().float(), c.q, d1, -m1))
    with pytest.raises(HalError, match="raw"):
        (k_quants.q4_k_codes if kind == "Q4_K" else k_quants.q5_k_codes)(raw[:-1], (N, K))


def random_q5_0(N: int, K: int, seed: int) -> np.ndarray:
    """Random GGUF Q5_0 blocks (every code and fifth-bit byte drawn, a finite fp16 d per block)."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (N * K // 32, k_quants.Q5_0_BLOCK), dtype=np.uint8)
    b[:, 0:2] = (rng.random(N * K // 32) * 1e-3 + 1e-5).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def test_q5_0_bytes_load_into_tiles_as_gguf_dequantizes_them():
    """ggml's Q5_0 layout read here (nibbles and the uint32 of fifth bits) gives, as d·(q − 16)
    in float32, exactly gguf's dequantization; the tiles' products are the reference arithmetic."""
    N, K = 48, 96
    raw = random_q5_0(N, K, seed=13)
    dense = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0).reshape(N, K).copy())
    c = k_quants.q5_0_codes(raw, (N, K))
    assert int(c.q.min()) == 0 and int(c.q.max()) == 31   # every code value drawn
    assert torch.equal((c.d[..., None] * (c.q.float().view(N, -1, 32) - 16)).reshape(N, K), dense)
    w = c.pack(torch.bfloat16)
    x = rows(5, K, seed=14)
    assert torch.equal(w.mm(x), q4_reference.reference_mm(x.bfloat16().float(), c.q, c.d, -16 * c.d))
    with pytest.raises(HalError, match="raw"):
        k_quants.q5_0_codes(raw[:-1], (N, K))
    with pytest.raises(HalError, match="weight"):
        q4_rows.pack_q5(c.q + 1, c.d, torch.float32)   # a code of 32


def test_bad_input_is_refused_naming_the_argument():
    blocks, _ = q4_case(48, 64, 0)
    odd = int4.Int4Blocks(blocks.codes, blocks.scales * (1 + 1e-7), blocks.zeros)   # not fp16 values
    for fn, arg in ((lambda: q4_rows.pack(odd, torch.float32), "weight"),
                    (lambda: q4_rows.Q4Weight(torch.zeros(3, 3, 320, dtype=torch.uint8), (48, 64), False,
                                              torch.float32), "weight"),
                    (lambda: q4_rows.Q4Weight(torch.zeros(3, 2, 320, dtype=torch.uint8), (48, 64), False,
                                              torch.float16), "weight"),
                    (lambda: q4_rows.pack_q8(torch.zeros(48, 60, dtype=torch.int8), torch.ones(48, 2),
                                             torch.float32), "weight"),
                    (lambda: q4_rows.from_q8_0(np.zeros(10, np.uint8), (48, 64), torch.float32), "raw"),
                    (lambda: q4_rows.pack_q8(torch.zeros(48, 64, dtype=torch.int8), torch.full((48, 2), 1e-9),
                                             torch.float32), "weight"),   # scales fp16 would round
                    (lambda: choose_plan([(96, 64)], "stored", stored_int4=[True], cache=False, form="int8"), "form"),
                    (lambda: q4_rows.pack(blocks, torch.float32).mm(torch.zeros(2, 32)), "x"),
                    (lambda: q4_rows.pack(blocks, torch.float32).mm(torch.zeros(2, 64, dtype=torch.int32)), "x"),
                    (lambda: q4_rows.pack(blocks, torch.float32).to("meta"), "device"),
                    (lambda: q4_rows.pack(blocks, torch.float32).with_codes(3), "weight"),   # 1 or 2 int8 codes
                    (lambda: LinearPlan("mm", torch.bfloat16, (1,), weights="q4q8", codes=0), "codes"),
                    (lambda: q4_rows.pack_q6k(torch.full((48, 256), 40, dtype=torch.int8), torch.ones(48, 8),
                                              torch.ones(48, 16, dtype=torch.int8), torch.float32), "weight"),  # code > 31
                    (lambda: q4_rows.pack_q6k(torch.zeros(48, 256, dtype=torch.int8), torch.ones(48, 8),
                                              torch.ones(48, 3, dtype=torch.int8), torch.float32), "weight"),
                    (lambda: q4_rows.pack_q6k(torch.zeros(48, 64, dtype=torch.int8), torch.ones(48, 2),
                                              torch.ones(48, 4, dtype=torch.int8), torch.float32), "weight"),  # K % 256
                    (lambda: q4_rows.pack_q6k(torch.zeros(48, 256, dtype=torch.int8), torch.arange(8.).expand(48, 8),
                                              torch.ones(48, 16, dtype=torch.int8), torch.float32), "weight"),  # d varies in a super-block
                    (lambda: q4_rows.pack_q4k(torch.zeros(48, 256, dtype=torch.uint8), torch.full((48, 8), 1e-9),
                                              torch.ones(48, 8), torch.ones(48, 8), torch.ones(48, 8),
                                              torch.float32), "weight"),   # d fp16 would round
                    (lambda: q4_rows.pack_q4k(torch.zeros(48, 256, dtype=torch.uint8), torch.ones(48, 8),
                                              torch.arange(8.).expand(48, 8), torch.ones(48, 8), torch.ones(48, 8),
                                              torch.float32), "weight"),   # dmin varies in a super-block
                    (lambda: q4_rows.pack_q4k(torch.zeros(48, 64, dtype=torch.uint8), torch.ones(48, 2),
                                              torch.ones(48, 2), torch.ones(48, 2), torch.ones(48, 2),
                                              torch.float32), "weight")):   # K % 256
        with pytest.raises(HalError) as e:
            fn()
        assert e.value.arg == arg


SHAPES, STORED = [(96, 64), (64, 64), (500, 64)], [True, True, False]


def test_the_plan_measures_q4q8_and_its_rows_are_independent():
    choice = choose_plan(SHAPES, "stored", stored_int4=STORED, cache=False)
    assert any(c["plan"]["weights"] == "q4q8" for c in choice.candidates), choice.candidates


def test_a_q4q8_kernel_that_mixes_rows_is_never_chosen(monkeypatch):
    real = plan_check.int4_mm
    def mixing(x, w):   # PLANTED: q4q8 rows get a term from every row of their call
        out = real(x, w)
        return out + x.float().sum(0, keepdim=True)[:, :1] * 1e-2 if isinstance(w, q4_rows.Q4Weight) else out
    monkeypatch.setattr(plan_check, "int4_mm", mixing)
    choice = choose_plan(SHAPES, "stored", stored_int4=STORED, cache=False)
    assert any("q4q8" in why and "batch-mates" in why for why in choice.rejected), choice.rejected
    assert all(c["plan"]["weights"] != "q4q8" or c["plan"]["widths"] == [1] for c in choice.candidates)


def test_no_cxx_compiler_leaves_plans_without_q4q8(monkeypatch, tmp_path):
    plant_failing_compiler(monkeypatch, tmp_path, "CXX", q4_rows)
    with pytest.warns(RuntimeWarning, match="q4q8 kernel did not build.*planted failure"):
        choice = choose_plan(SHAPES, "stored", stored_int4=STORED, cache=False)
    assert choice.plan.weights == "int4" and all(c["plan"]["weights"] == "int4" for c in choice.candidates)


def test_a_dequantized_q8_0_weight_quantizes_back_to_its_stored_codes():
    """A drafter's weights under a q4q8 plan are quantized as Q8_0 is; the target's lm_head
    rows it shares were dequantized from Q8_0, and get their stored codes back."""
    N, K = 48, 96
    raw = quants.quantize(np.random.default_rng(1).standard_normal((N, K)).astype(np.float32) * 0.05, KINDS["Q8_0"])
    dense = torch.from_numpy(quants.dequantize(raw, KINDS["Q8_0"]).reshape(N, K).copy())
    assert torch.equal(q4_rows.quantize_q8(dense, torch.bfloat16).packed,
                       q4_rows.from_q8_0(raw, (N, K), torch.bfloat16).packed)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    got = q4_rows.quantize_q8(w, torch.float32).mm(torch.eye(64))   # the weight as the kernel sees it, transposed
    assert (got.T - w).abs().max() <= w.abs().max() / 127   # half a step of the largest group scale, and then some
    with pytest.raises(HalError) as e:
        q4_rows.quantize_q8(torch.zeros(40, 64), torch.float32)
    assert e.value.arg == "weight"


def test_drafter_weights_run_as_q8_tiles_only_under_a_q4q8_plan():
    from types import SimpleNamespace

    from hal.models.linear_layout import LinearPlan
    from hal.models.llama import Llama
    w = torch.randn(64, 96)
    def target(weights, invariant=True):
        return SimpleNamespace(plan=LinearPlan("mm", torch.bfloat16, (1,), weights=weights), batch_invariant=invariant,
                               device=torch.device("cpu"), dtype=torch.bfloat16)
    got = Llama.draft_weight(target("q4q8"), w, torch.device("cpu"))
    assert isinstance(got, q4_rows.Q4Weight) and got.q8 and got.shape == (64, 96)
    for t, shape in ((target("int4"), (64, 96)), (target("q4q8", invariant=False), (64, 96)), (target("q4q8"), (50, 96))):
        other = Llama.draft_weight(t, torch.randn(*shape), torch.device("cpu"))
        assert isinstance(other, torch.Tensor) and other.dtype == torch.bfloat16


def test_q4_1_mins_are_packed_as_stored_even_where_float32_sums_round_them():
    """A Q4_1 block whose min is large beside its scale: m + 8d rounds in float32, so the min
    is kept as read (`Int4Blocks.mins`), and the tiles hold the file's fp16 values."""
    N, K = 16, 32
    blocks = np.zeros((N, 1, 20), np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.00933837890625).tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(8192.0).tobytes(), np.uint8)   # a pair where (m + 8d) - 8d != m
    blocks[..., 4:] = np.arange(16, dtype=np.uint8) * 17   # codes 0..15 in both nibbles
    b = int4.from_blocks(blocks.reshape(-1), "Q4_1", (N, K))
    assert not torch.equal(b.zeros - 8 * b.scales, b.mins)   # the float32 sum lost the min
    w = q4_rows.pack(b, torch.float32)
    x = rows(3, K, seed=9)
    assert torch.equal(w.mm(x), q4_reference.reference_mm(x, b.codes, b.scales, b.mins))
