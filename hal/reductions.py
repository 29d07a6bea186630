"""Reductions torch does not vectorise on a CPU, in passes it does, with torch's own results."""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256   # columns per block of `first_max`'s first pass


def first_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.max(-1)`` over the last dim of ``[R, V]``: each row's maximum and its first maximal index
    (ties to the lowest index; a NaN is the maximum, the first NaN its index), as torch's ``max``
    and ``argmax`` give them (tests/test_reductions.py). On a CPU torch's indexed reductions do not
    vectorise and its plain ones do (benchmarks/reductions.py): so each block of `BLOCK` columns is
    reduced by ``amax``, and only the first block that holds the row's maximum (or a NaN) is
    searched by ``argmax``."""
    rows, count = x.shape
    whole = count // BLOCK * BLOCK
    tops = [x[:, :whole].reshape(rows, whole // BLOCK, BLOCK).amax(-1)] if whole else []
    if whole < count:
        tops.append(x[:, whole:].amax(-1, keepdim=True))
    blocks = torch.cat(tops, 1) if len(tops) > 1 else tops[0]   # [R, blocks]
    top = blocks.amax(-1)                                        # NaN where the row has one
    first = (blocks == top[:, None]) | blocks.isnan()
    block = first.int().argmax(-1)                               # the first block holding it
    cols = (block[:, None] * BLOCK + torch.arange(BLOCK, device=x.device)).clamp(max=count - 1)
    return top, block * BLOCK + x.gather(1, cols).argmax(-1)    # a clamped tail repeats its last column
