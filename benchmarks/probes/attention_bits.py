"""The native attention kernel (`hal/models/row_kernels.c`) of this checkout against an earlier
commit's, bit for bit: both sources compiled here with the row kernels' flags, for this CPU
(``-march=native``) and for AVX2 (``-march=x86-64-v3``: 8-lane vectors), and run on the same
random ragged queries, head shapes, key counts (1 to 69, and either side of 256), float32 and
bfloat16 caches, some with a NaN or an infinite key. Prints the cases compared and any that
differ; writes nothing else.

    python benchmarks/probes/attention_bits.py --before <commit>
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hal.models import invariant  # noqa: E402
from hal.models.row_kernels import FLAGS, FusedRows  # noqa: E402

SOURCE = "hal/models/row_kernels.c"


def build(text: str, march: str, out: Path) -> FusedRows:
    src = out.with_suffix(".c")
    src.write_text(text)
    flags = [f"-march={march}" if f == "-march=native" else f for f in FLAGS]
    subprocess.run(["cc", *flags, "-o", str(out), str(src), "-lm"], check=True)
    return FusedRows(ctypes.CDLL(str(out)), out)


def compare(old: FusedRows, new: FusedRows) -> tuple[int, list]:
    g = torch.Generator().manual_seed(0)
    cases, differ = 0, []
    for dtype in (torch.float32, torch.bfloat16):
        for D, Hq, Hkv in ((64, 9, 3), (128, 8, 2), (32, 4, 4), (16, 6, 1)):
            for L in [*range(1, 70), 255, 256, 257, 600]:
                for T in (1, 3):
                    bs = 16
                    nb = (L + T) // bs + 2
                    kc = (torch.randn(nb, bs, Hkv, D, generator=g) * 3).to(dtype)
                    vc = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
                    if L % 7 == 0:
                        kc[0, 0, 0, 0] = float("nan") if L % 14 == 0 else float("inf")
                    keys = invariant.KeyLists(torch.randperm(nb, generator=g)[None].long(), torch.tensor([L + T]),
                                              torch.tensor([0, T]), T, T, None, None)
                    q = torch.randn(T, Hq, D, generator=g) * 2
                    a, b = old.attention(q, kc, vc, keys, 0.125), new.attention(q, kc, vc, keys, 0.125)
                    cases += 1
                    if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                        differ.append((str(dtype), D, Hq, Hkv, L, T))
    return cases, differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the commit whose kernel to compare with")
    args = ap.parse_args()
    before = subprocess.run(["git", "show", f"{args.before}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    with tempfile.TemporaryDirectory(prefix="hal-bits-") as tmp:
        for march in ("native", "x86-64-v3"):
            old = build(before, march, Path(tmp) / f"old-{march}.so")
            new = build((ROOT / SOURCE).read_text(), march, Path(tmp) / f"new-{march}.so")
            cases, differ = compare(old, new)
            print(f"-march={march}: {cases} cases, {len(differ)} differ" + (f": {differ[:5]}" if differ else ""))


if __name__ == "__main__":
    main()
