"""The fused row kernels (`hal.models.row_kernels`, compiled from `row_kernels.c`): each
against the eager ATen steps or the cpu backend's attention within stated tolerances; each
row's bits independent of its batch-mates and of the input's strides; the fused attention's
rows equal across a decode, a verify and a batch; bad input refused before the C code sees
it; a compiler that fails leaves the runner eager, with a warning.

Tolerances: float32 outputs within 1e-5 relative (the kernels sum in another order and use a
polynomial exp, about 1 ulp); bfloat16 outputs within one bfloat16 step (2**-7 relative) of
the eager float32 result rounded, since a different last float32 bit can round the other way."""

from __future__ import annotations

import ctypes

import pytest
import torch

import hal
from hal.errors import HalError
from hal.models import invariant, row_kernels
from hal.models.row_kernels import EagerRows, FusedRows
from tests.models.compilers import plant_failing_compiler

EAGER = EagerRows()
BF16_STEP = dict(rtol=2 ** -7, atol=1e-6)
F32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def fused():
    rows = row_kernels.rows_for(torch.device("cpu"))
    assert isinstance(rows, FusedRows), "the row kernels did not build on this machine"
    return rows


def _close(got, want, dtype):
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.to(dtype).float(), **BF16_STEP)
    else:
        torch.testing.assert_close(got, want, **F32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_matches_eager_and_adds_in_place(fused, dtype):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 576, generator=g), 1 + 0.1 * torch.randn(576, generator=g)
    d = torch.randn(9, 576, generator=g).to(dtype)
    want_h, want_x = EAGER.add_norm(h, d, w, 1e-5)
    got_h, got_x = fused.add_norm(h.clone(), d, w, 1e-5, dtype)
    assert torch.equal(got_h, want_h), "the residual add is one float32 add per element in both"
    assert got_x.dtype == dtype
    _close(got_x, want_x, dtype)
    _, only_norm = fused.add_norm(h.clone(), None, w, 1e-5, dtype)
    _close(only_norm, EAGER.add_norm(h, None, w, 1e-5)[1], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norm_matches_eager_in_place_on_its_columns_only(fused, dtype):
    """Qwen3's per-head q/k norm on a view of the fused projections (row stride wider than the
    heads): the heads are normed in place, within a rounding of the eager steps (which round
    twice in bfloat16), and the columns past the view are untouched. PLANTED: a kernel that
    forgets the weight fails the match."""
    g = torch.Generator().manual_seed(4)
    qkv = (4 * torch.randn(7, 5 * 64, generator=g)).to(dtype)
    w = 1 + 0.3 * torch.randn(64, generator=g)
    want = EAGER.head_norm(qkv[:, :4 * 64], 4, w, 1e-6)
    rest = qkv[:, 4 * 64:].clone()
    got = fused.head_norm(qkv[:, :4 * 64], 4, w, 1e-6)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, 4 * 64:], rest)
    _close(got, want.float(), dtype)
    with pytest.raises(AssertionError):
        _close(fused.head_norm(qkv[:, :4 * 64].clone(), 4, torch.ones(64), 1e-6), want.float(), dtype)
    with pytest.raises(HalError, match="w: expected contiguous float32 .64."):
        fused.head_norm(qkv[:, :4 * 64], 4, torch.ones(32), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_rope_match_eager(fused, dtype):
    g = torch.Generator().manual_seed(1)
    gu = (3 * torch.randn(5, 3072, generator=g)).to(dtype)
    _close(fused.silu_mul(gu), EAGER.silu_mul(gu), dtype)
    big = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0, 1.0]]).to(dtype)   # exp's clamped range
    assert torch.isfinite(fused.silu_mul(big).float()).all()
    rot = torch.polar(torch.ones(5, 32), torch.rand(5, 32, generator=g) * 100)
    qkv = torch.randn(5, 960, generator=g).to(dtype)
    for interleaved in (True, False):
        torch.testing.assert_close(fused.rope(qkv[:, :576], rot, 9, interleaved),
                                   EAGER.rope(qkv[:, :576], rot, 9, interleaved), **F32)


def test_rows_do_not_depend_on_batch_mates_or_strides(fused):
    """Each kernel's row alone, among 9, and read through a strided view: the same bits."""
    g = torch.Generator().manual_seed(2)
    w = 1 + 0.1 * torch.randn(576, generator=g)
    wide = torch.randn(9, 2 * 576, generator=g).to(torch.bfloat16)
    d = wide[:, 576:]                                     # rows of stride 1152
    h = torch.randn(9, 576, generator=g)
    gu = torch.randn(9, 3072, generator=g).to(torch.bfloat16)
    rot = torch.polar(torch.ones(9, 32), torch.rand(9, 32, generator=g) * 50)
    _, all_x = fused.add_norm(h.clone(), d, w, 1e-5, torch.bfloat16)
    all_a = fused.silu_mul(gu)
    all_q = fused.rope(wide[:, 64:640], rot, 9, True)
    for i in (0, 4, 8):
        assert torch.equal(fused.add_norm(h[i:i + 1].clone(), d[i:i + 1].contiguous(), w, 1e-5,
                                          torch.bfloat16)[1][0], all_x[i])
        assert torch.equal(fused.silu_mul(gu[i:i + 1])[0], all_a[i])
        assert torch.equal(fused.rope(wide[i:i + 1, 64:640].contiguous(), rot[i:i + 1], 9, True)[0], all_q[i])
    cols = torch.randn(576, 9, generator=g).T                           # columns: not unit-stride rows
    assert torch.equal(fused.silu_mul(torch.cat([cols, cols], 1))[3], fused.silu_mul(torch.cat([cols, cols], 1)[3:4])[0])
    assert torch.equal(fused.add_norm(h.clone(), cols, w, 1e-5)[1], fused.add_norm(h.clone(), cols.contiguous(), w,
                                                                                     1e-5)[1])


def _cache(g, dtype=torch.float32):
    return (torch.randn(12, 16, 3, 64, generator=g).to(dtype), torch.randn(12, 16, 3, 64, generator=g).to(dtype))


def _attend(fused, q, kc, vc, bt, seq, qsl, max_query, tree_mask=None, slots=None):
    keys = invariant.KeyLists(bt, seq, qsl, q.shape[0], max_query, tree_mask, slots)
    return fused.attention(q, kc, vc, keys, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_the_reference_on_ragged_batches(fused, dtype):
    g = torch.Generator().manual_seed(3)
    kc, vc = _cache(g, dtype)
    q = torch.randn(1 + 9 + 3, 9, 64, generator=g)
    bt = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 0], [7, 8, 9, 10]], dtype=torch.int32)
    seq, qsl = torch.tensor([17, 40, 64]), torch.tensor([0, 1, 10, 13])
    want = hal.get_backend("cpu").paged_attention(q, kc.float(), vc.float(), bt, seq, qsl, 0.125)
    torch.testing.assert_close(_attend(fused, q, kc, vc, bt, seq, qsl, 9), want, atol=1e-5, rtol=0)


def test_attention_query_does_not_depend_on_the_batch(fused):
    """The query at position 40 decoded alone, as query 5 of a 9-token verify, and beside a
    longer request with a wider block table: the same bits."""
    g = torch.Generator().manual_seed(4)
    kc, vc = _cache(g, torch.bfloat16)
    q_t = torch.randn(1, 9, 64, generator=g)
    bt = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    alone = _attend(fused, q_t, kc, vc, bt, torch.tensor([41]), torch.tensor([0, 1]), 1)
    qv = torch.randn(9, 9, 64, generator=g)
    qv[5] = q_t[0]
    assert torch.equal(_attend(fused, qv, kc, vc, bt, torch.tensor([44]), torch.tensor([0, 9]), 9)[5], alone[0])
    bt2 = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    mixed = _attend(fused, torch.cat([torch.randn(3, 9, 64, generator=g), qv]), kc, vc, bt2,
                    torch.tensor([140, 44]), torch.tensor([0, 3, 12]), 9)
    assert torch.equal(mixed[3 + 5], alone[0])
    strided_q = torch.randn(1, 9, 128, generator=g)[..., ::2]            # any strides: copied, same bits
    strided_q.copy_(q_t)
    assert torch.equal(_attend(fused, strided_q, kc, vc, bt, torch.tensor([41]), torch.tensor([0, 1]), 1), alone)


def test_bad_metadata_and_shapes_are_refused_before_the_kernel(fused):
    g = torch.Generator().manual_seed(5)
    kc, vc = _cache(g)
    q = torch.randn(1, 9, 64, generator=g)
    qsl = torch.tensor([0, 1])
    with pytest.raises(HalError, match="batch: expected .* within the cache's 12 blocks of 16, got a block id"):
        _attend(fused, q, kc, vc, torch.tensor([[0, 12]], dtype=torch.int32), torch.tensor([20]), qsl, 1)
    with pytest.raises(HalError, match="got a key count past its block table"):   # longer than its table
        _attend(fused, q, kc, vc, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([33]), qsl, 1)
    with pytest.raises(HalError, match="got a key count"):   # fewer cached tokens than fed
        _attend(fused, torch.randn(3, 9, 64), kc, vc, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2]),
                torch.tensor([0, 3]), 3)
    bt, seq = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20])
    with pytest.raises(HalError, match="q: expected heads a multiple"):
        _attend(fused, torch.randn(1, 9, 48), kc, vc, bt, seq, qsl, 1)
    with pytest.raises(HalError, match="v_cache: expected a contiguous host cache"):
        _attend(fused, q, kc, vc.transpose(1, 2).contiguous().transpose(1, 2), bt, seq, qsl, 1)
    with pytest.raises(HalError, match="v_cache"):
        _attend(fused, q, kc, vc.to(torch.bfloat16), bt, seq, qsl, 1)
    h = torch.randn(2, 576)
    with pytest.raises(HalError, match="d: expected"):
        fused.add_norm(h, torch.randn(3, 576), None, 1e-5)
    with pytest.raises(HalError, match="gu: expected"):
        fused.silu_mul(torch.randn(2, 7))
    with pytest.raises(HalError, match="rot: expected complex64"):
        fused.rope(torch.randn(2, 576), torch.randn(2, 32), 9, True)
    with pytest.raises(HalError, match="h: expected"):
        fused.add_norm(h.double(), None, None, 1e-5)
    with pytest.raises(HalError, match="w: expected contiguous float32 \\[576\\]"):
        fused.add_norm(h, None, torch.ones(575), 1e-5)
    with pytest.raises(HalError, match="dtype: expected one of"):
        fused.add_norm(h, None, torch.ones(576), 1e-5, torch.float16)
    with pytest.raises(HalError, match="x: expected \\[T, heads·D\\] with D even for 7 heads"):
        fused.rope(torch.randn(2, 576), torch.ones(2, 32, dtype=torch.complex64), 7, True)
    with pytest.raises(HalError, match="gu: expected float32 or bfloat16 \\[2, 8\\]"):
        fused.silu_mul(torch.randn(2, 8).half())
    before = h.clone()
    with pytest.raises(HalError, match="d: expected"):   # refused before anything is added
        fused.add_norm(h, torch.randn(2, 576).half(), None, 1e-5)
    assert torch.equal(h, before)


def test_a_compiler_that_fails_leaves_the_runner_eager_and_says_why(monkeypatch, tmp_path):
    with pytest.raises(HalError, match="row kernels: expected"):
        row_kernels.build(compiler=str(tmp_path / "no-such-cc"))
    plant_failing_compiler(monkeypatch, tmp_path, "CC", row_kernels)
    with pytest.warns(RuntimeWarning, match="did not build.*planted failure"):
        rows = row_kernels.rows_for(torch.device("cpu"))
    assert isinstance(rows, EagerRows) and not rows.attends(9, 3, 64)
    assert isinstance(row_kernels.rows_for(torch.device("meta")), EagerRows)


def test_the_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    first = row_kernels.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert row_kernels.build() == first and first.stat().st_mtime_ns == stamp, "rebuilt a cached build"
    lib = FusedRows(ctypes.CDLL(str(first)), first)
    x = torch.randn(2, 576)
    assert torch.equal(lib.add_norm(x.clone(), None, torch.ones(576), 1e-5)[1],
                       row_kernels.rows_for(torch.device("cpu")).add_norm(x.clone(), None, torch.ones(576), 1e-5)[1])


def test_a_planted_row_dependence_fails_the_batch_test(monkeypatch, tmp_path):
    """PLANTED: kernels whose attention scale drifts with the query's row index (1e-6 per row)
    fail `test_attention_query_does_not_depend_on_the_batch`, so its passing means something."""
    source = row_kernels.SOURCE.read_text()
    needle = "slots, L, scale,\n"
    assert source.count(needle) == 1
    planted = tmp_path / "row_kernels.c"
    planted.write_text(source.replace(needle, "slots, L, scale * (1.0f + 1e-6f * (float)t),\n"))
    monkeypatch.setattr(row_kernels, "SOURCE", planted)
    monkeypatch.setenv("HAL_CACHE", str(tmp_path / "cache"))
    path = row_kernels.build()
    with pytest.raises(AssertionError):
        test_attention_query_does_not_depend_on_the_batch(FusedRows(ctypes.CDLL(str(path)), path))


def test_rope_kv_writes_what_rope_and_the_backend_op_write(fused):
    """The fused ``rope_kv`` (layers after the first): queries as `rope` rotates them, keys and
    values in the cache as the backend's ``write_kv`` writes `rope`'s keys; padding slots (-1)
    untouched; a slot past the cache refused with nothing written."""
    g = torch.Generator().manual_seed(6)
    kc, vc = _cache(g, torch.bfloat16)
    qkv = torch.randn(4, 2000, generator=g)[:, 7:967].to(torch.bfloat16)          # strided rows
    rot = torch.polar(torch.ones(4, 32), torch.rand(4, 32, generator=g) * 50)
    slots = torch.tensor([3, -1, 40, 191])
    want_k, want_v = kc.clone(), vc.clone()
    k = fused.rope(qkv[:, 576:768], rot, 3, True)
    hal.get_backend("cpu").write_kv(k, qkv[:, 768:].reshape(4, 3, 64), want_k, want_v, slots)
    q = fused.rope_kv(qkv, rot, 9, 3, True, kc, vc, slots)
    assert torch.equal(q, fused.rope(qkv[:, :576], rot, 9, True))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    before = kc.clone()
    with pytest.raises(HalError, match="slots: expected -1 or slots below the cache's 192"):
        fused.rope_kv(qkv, rot, 9, 3, True, kc, vc, torch.tensor([5, 6, 192, 7]))
    assert torch.equal(kc, before), "a refused write changed the cache"
    with pytest.raises(HalError, match="qkv: expected"):
        fused.rope_kv(qkv[:, :900], rot, 9, 3, True, kc, vc, slots)
    with pytest.raises(HalError, match="slots: expected contiguous int64"):
        fused.rope_kv(qkv, rot, 9, 3, True, kc, vc, slots.int())
    with pytest.raises(HalError, match="v_cache: expected a contiguous host cache"):
        fused.rope_kv(qkv, rot, 9, 3, True, kc, vc.float(), slots)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("march", ["x86-64-v3"])   # AVX2 + FMA, as on an AVX2-only machine
def test_kernels_built_for_older_cpus_keep_rows_independent(monkeypatch, tmp_path, march):
    """The kernels as an AVX2-only machine compiles them (-march=native there: 8-lane vectors).
    Built so here (this CPU runs that code too), they still give every row the same bits alone
    and among batch-mates, and agree with the eager steps and the reference attention."""
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 microarchitecture levels only")
    monkeypatch.setenv(row_kernels.MARCH_ENV, march)
    monkeypatch.setenv("HAL_CACHE", str(tmp_path))
    path = row_kernels.build()
    assert f"-march={march}" in row_kernels.flags() and "-march=native" not in row_kernels.flags()
    older = FusedRows(ctypes.CDLL(str(path)), path)
    test_rows_do_not_depend_on_batch_mates_or_strides(older)
    test_attention_query_does_not_depend_on_the_batch(older)
    for dtype in (torch.float32, torch.bfloat16):
        test_silu_mul_and_rope_match_eager(older, dtype)
        test_attention_matches_the_reference_on_ragged_batches(older, dtype)
