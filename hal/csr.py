"""The op contract's CSR layout on the host: per-row counts to row offsets."""

from __future__ import annotations

from itertools import accumulate


def cumulative(counts) -> list[int]:
    """``[0, c0, c0 + c1, ...]``: row i's items are ``[out[i], out[i + 1])`` (``len(counts) + 1`` values,
    the host form of ``cu_num_draft_tokens``)."""
    return list(accumulate(counts, initial=0))
