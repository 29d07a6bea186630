"""`hal.models.huge_pages.resident`: a packed weight copied into huge-page-advised memory keeps
its values, shape and dtype; small tensors pass through; the kernel reads the copy as it read
the original (the hint changes no bit)."""

from __future__ import annotations

import sys

import pytest
import torch

from hal.models import huge_pages, q4_rows


def test_a_large_tensor_is_copied_aligned_with_its_values():
    t = torch.randint(0, 256, (3, huge_pages.MIN_BYTES // 3 + 7), dtype=torch.uint8)
    out = huge_pages.resident(t)
    assert out.shape == t.shape and out.dtype == t.dtype and out.is_contiguous() and torch.equal(out, t)
    if sys.platform.startswith("linux"):
        assert out.data_ptr() % huge_pages.HUGE == 0 and out.data_ptr() != t.data_ptr()


def test_a_small_tensor_passes_through():
    t = torch.zeros(1000, dtype=torch.uint8)
    assert huge_pages.resident(t) is t


@pytest.mark.skipif(not q4_rows.available(), reason="no C++ compiler: no q4q8 kernel")
def test_packed_weights_live_in_advised_memory_and_multiply_as_before():
    g = torch.Generator().manual_seed(0)
    w = q4_rows.random_q8(4096, 2048, g, torch.float32)   # 9.5 MB of tiles: above MIN_BYTES
    if sys.platform.startswith("linux"):
        assert w.packed.data_ptr() % huge_pages.HUGE == 0
    plain = q4_rows.Q4Weight(w.packed.clone(), w.shape, w.q8, w.dtype)   # the same tiles in ordinary memory
    x = torch.randn(3, 2048, generator=g)
    assert torch.equal(w.mm(x), plain.mm(x))
