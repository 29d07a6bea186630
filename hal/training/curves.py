"""Training curves as PNG (`spec-hal train-head` writes one beside each drafter)."""

from __future__ import annotations

from pathlib import Path


def plot(curve, path: Path, labels: tuple[str, str, str, str]) -> None:
    """Rows (seconds, step, loss, second curve, train metric, validation metric or None) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    s = [c[1] for c in curve]
    ax[0].plot(s, [c[2] for c in curve], label=labels[0])
    ax[0].plot(s, [c[3] for c in curve], label=labels[1])
    ax[0].set_yscale("log")
    ax[0].set_xlabel("step")
    ax[0].legend()
    ax[1].plot(s, [c[4] for c in curve], alpha=0.4, label=labels[2])
    v = [(c[1], c[5]) for c in curve if c[5] is not None]
    ax[1].plot([a for a, _ in v], [b for _, b in v], "o-", label=labels[3])
    ax[1].set_xlabel("step")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
