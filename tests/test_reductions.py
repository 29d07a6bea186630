"""`hal.reductions.first_max` gives what torch's own ``max(-1)`` and ``argmax(-1)`` give, bit for bit,
on rows with exact ties, NaNs, infinities and every float dtype the engine verifies in."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hal.reductions import first_max


def _rows(seed: int, rows: int, width: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, width), generator=g).to(dtype)   # few values: many exact ties
    special = torch.rand(rows, width, generator=g)
    x[special < 0.02] = float("nan")
    x[(special >= 0.02) & (special < 0.04)] = float("inf")
    x[(special >= 0.04) & (special < 0.06)] = float("-inf")
    x[rows // 2:] = x[rows // 2:] + torch.randn(rows - rows // 2, width, generator=g).to(dtype)   # distinct values
    return x


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(0, 9), width=st.integers(1, 1100),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_first_max_is_torchs_max_and_argmax(seed, rows, width, dtype):
    x = _rows(seed, rows, width, dtype)
    top, at = first_max(x)
    want_top, want_at = x.max(-1) if rows else (x.new_empty(0), torch.zeros(0, dtype=torch.long))
    assert torch.equal(at, x.argmax(-1) if rows else want_at) and torch.equal(at, want_at)
    assert at.dtype == torch.long and torch.equal(top.isnan(), want_top.isnan())
    assert torch.equal(top[~top.isnan()], want_top[~want_top.isnan()])


@pytest.mark.parametrize("row", [[float("nan")] * 5, [float("-inf")] * 5, [1.0, float("nan"), 2.0, float("nan"), 2.0],
                                 [0.0, -0.0, 0.0], [float("inf"), float("inf"), 1.0], [-1.0, 3.0, 3.0, 3.0]])
def test_edge_rows(row):
    x = torch.tensor([row])
    assert first_max(x)[1].item() == x.argmax(-1).item()


def test_a_vocabulary_wide_row_set():
    x = torch.randn(7, 49152)
    x[3, 100] = x[3, 40000] = x[3].max() + 1   # a tie far apart
    assert torch.equal(first_max(x)[1], x.argmax(-1)) and first_max(x)[1][3] == 100


@pytest.mark.parametrize("at", [0, 255, 256, 1000, 49151])
def test_one_nan_or_one_maximum_anywhere_in_a_wide_row(at):
    x = torch.randn(3, 49152)
    x[0, at] = float("nan")
    x[1, at] = 100.0
    x[2, at] = float("inf")
    x[2, at // 2] = float("inf")   # the first of two
    top, idx = first_max(x)
    assert idx.tolist() == x.argmax(-1).tolist() == [at, at, at // 2]
    assert top[0].isnan() and top[1:].tolist() == [100.0, float("inf")]
