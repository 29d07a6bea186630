"""The linear plan's self-check (`hal.models.linear_plan`): which chunk widths give a row the
same bits whatever its batch-mates and position, per layout and dtype, on every weight shape."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from hal.models import int4, q4_rows

Layout = Callable[[Tensor, Tensor], Tensor]   # (x [M, K], w [N, K]) -> x @ w.T [M, N]
Stored = Callable[[int, int, torch.Generator, torch.dtype], object]   # (N, K, gen, rows) -> a random stored weight
PROBE_WIDTHS = (1, 2, 4, 8, 16)


def int4pack(N: int, K: int, g: torch.Generator, dtype: torch.dtype) -> int4.Int4Weight:
    """A random int4 weight in int4pack's form (the default stored form the check runs)."""
    return int4.random(N, K, g).pack(dtype)


def q4q8(N: int, K: int, g: torch.Generator, dtype: torch.dtype) -> q4_rows.Q4Weight:
    """A random int4 weight in the q4q8 kernel's tiles (`hal.models.q4_rows`)."""
    return q4_rows.pack(q4_rows.random(N, K, g), dtype)


def q8_tiles(N: int, K: int, g: torch.Generator, dtype: torch.dtype) -> q4_rows.Q4Weight:
    """A random Q8_0 weight (an lm_head as stored) in the q4q8 kernel's Q8 tiles."""
    return q4_rows.random_q8(N, K, g, dtype)


def q6_tiles(N: int, K: int, g: torch.Generator, dtype: torch.dtype) -> q4_rows.Q4Weight:
    """A random Q6_K weight in the q4q8 kernel's Q6 tiles."""
    return q4_rows.random_q6k(N, K, g, dtype)


def q4k_tiles(N: int, K: int, g: torch.Generator, dtype: torch.dtype) -> q4_rows.Q4Weight:
    """A random Q4_K weight in the q4q8 kernel's Q4K tiles (a Q4_K_M file's mixed linears are timed so,
    its Q5_0 and Q5_K ones too: a Q5 or Q5K tile is a Q4 or Q4K tile and 64 bytes of fifth bits)."""
    return q4_rows.random_q4k(N, K, g, dtype)


STORED_FORMS: dict[str, Stored] = {"int4": int4pack, "q4q8": q4q8}   # a plan's weights form -> its check's weights


class StoredShapes(frozenset):
    """The weight shapes a file stores in blocks that run as stored; ``q8``, ``q6``: those stored
    as Q8_0 or Q6_K (the q4q8 kernel's Q8 or Q6 tiles; an int4pack plan runs them as floats)."""

    def __new__(cls, shapes=(), q8=frozenset(), q6=frozenset(), q4k=frozenset()):
        self = super().__new__(cls, shapes)
        self.q8, self.q6, self.q4k = frozenset(q8), frozenset(q6), frozenset(q4k)
        return self

    def of(self, kind: str) -> frozenset:
        """The shapes ``kind``'s candidates run as stored."""
        return frozenset(self) if kind == "q4q8" else \
            frozenset(self - self.q8 - self.q6 - self.q4k if kind in STORED_FORMS else ())

    def stored(self, kind: str) -> Stored:
        """A random weight of a shape in ``kind``'s stored form (its self-check and timing)."""
        if kind != "q4q8" or not (self.q8 or self.q6 or self.q4k):
            return STORED_FORMS.get(kind, int4pack)
        return lambda N, K, g, dt: (q8_tiles if (N, K) in self.q8 else q6_tiles if (N, K) in self.q6 else
                                    q4k_tiles if (N, K) in self.q4k else q4q8)(N, K, g, dt)


def as_stored(shapes) -> StoredShapes:
    """``shapes`` as `StoredShapes` (a plain set: none of them Q8_0)."""
    return shapes if isinstance(shapes, StoredShapes) else StoredShapes(shapes)


def int4_mm(x: Tensor, w) -> Tensor:
    """``x @ W.T`` for weights run as stored (int4pack's `hal.models.int4.Int4Weight` or a
    `hal.models.q4_rows.Q4Weight`); the plan and its self-check both call it here, so a
    planted kernel is seen by both."""
    return w.mm(x)


def usable_groups(fn: Layout, dtype: torch.dtype, shapes: list[tuple[int, int]], widths=PROBE_WIDTHS,
                  seed: int = 0, device: torch.device | None = None, rows: int = 64,
                  int4_shapes: frozenset = frozenset(), stored: Stored = int4pack
                  ) -> tuple[list[tuple[int, ...]], list[str]]:
    """Width groups whose rows are independent of their batch-mates and position and agree
    bit for bit within the group, on every shape ``[N, K]`` (on ``device``); and why the
    other widths fail. Shapes in ``int4_shapes`` are checked with random weights in the
    ``stored`` form (default int4pack's, `hal.models.int4`), multiplied with ``dtype`` rows.

    ``rows`` random rows are computed in chunks of each width twice, in two random orders (so
    each row meets other mates at another position): a width whose rows change is dropped.
    Widths are grouped by the bits of all those rows; many rows are needed because two
    accumulation orders rounded to bfloat16 agree on most values and differ on a few."""
    g = torch.Generator().manual_seed(seed)
    dev = device or torch.device("cpu")
    bits: dict[int, list[bytes]] = {n: [] for n in widths}
    why = []
    for N, K in shapes:
        packed = (N, K) in int4_shapes
        w = stored(N, K, g, dtype) if packed else torch.randn(N, K, generator=g).to(dev, dtype)
        x = torch.randn(rows, K, generator=g).to(dev, dtype)
        mm = int4_mm if packed else fn
        orders = [torch.randperm(rows, generator=g) for _ in range(2)]
        for n in list(bits):
            runs = []
            for order in orders:
                out = torch.empty(rows, N, dtype=torch.float32, device=dev)
                for start in range(0, rows, n):
                    idx = order[start:start + n]
                    chunk = x[idx.to(dev)]
                    if len(idx) < n:   # the last chunk: random mates as padding
                        chunk = torch.cat([chunk, torch.randn(n - len(idx), K, generator=g).to(dev, dtype)])
                    out[idx.to(dev)] = mm(chunk.contiguous(), w)[:len(idx)].float()
                runs.append(out.cpu().numpy().tobytes())
            if runs[0] != runs[1]:
                why.append(f"width {n} on {'int4 ' * packed}[{N}, {K}]: a row's bits depend on its batch-mates "
                           f"or position")
                del bits[n]
                continue
            bits[n].append(runs[0])
    groups: dict[tuple, list[int]] = {}
    for n, sig in bits.items():
        groups.setdefault(tuple(sig), []).append(n)
    return [tuple(ws) for ws in groups.values()], why
