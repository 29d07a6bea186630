"""What the ``*_written_check.py`` scripts share: their command line, spec-hal's side of a block
drafter's proposal (the target's tapped features of a prompt, one `DraftBatch`), and the report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def parse(doc: str, name: str, src_help: str) -> argparse.Namespace:
    """``--src`` (the authors' checkout) and ``--out`` (default ``benchmarks/results/<name>.md``); one thread."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--src", type=Path, required=True, help=src_help)
    ap.add_argument("--out", type=Path, default=REPO / f"benchmarks/results/{name}.md")
    torch.set_num_threads(1)
    return ap.parse_args()


def block_proposal(drafter, target, ids: list[int], n: int, taps, k: int, temperature: float = 0.0):
    """A block drafter's proposal for the request ``ids`` (its last token the anchor), fed the
    target's features at taps ``taps`` of the first ``n`` tokens."""
    from hal import kv
    from hal.engine.drafting import DraftBatch
    from hal.engine.forward import forward_tokens
    from hal.engine.requests import Request
    c = target.cfg
    pool = kv.KVPool(target.be, 8, 16, c.kv_heads, c.head_dim, num_layers=target.num_layers)
    rows = torch.arange(n)
    feats = forward_tokens(target, pool, [pool.sequence()], [n], torch.tensor(ids[:n]), rows=rows[-1:],
                           hidden_rows=rows, feature_layers=tuple(taps))[1]
    return drafter.propose(DraftBatch(
        rids=(0,), params=(Request(ids, k=k, temperature=temperature, seed=5),), history=torch.tensor([ids]),
        num_tokens=torch.tensor([n + 1]), lengths=(n + 1,), k=(k,), offsets=(0,), features=feats,
        num_features=(n,)))


def report(out: Path, lines: list[str], ok: bool) -> None:
    """Write and print the report; exit 1 where the two sides differ."""
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    if not ok:
        sys.exit(1)
